# GPU image for gspo-mcore (8xH100 nodes): CUDA + torch + Transformer Engine +
# megatron-core 0.16.1 + SGLang 0.5.23 + this package, and vLLM 0.33.0 in its own Python
# (/opt/vllm) for rollout.engine: vllm.     make docker
#
# Base: SGLang's own release image (CUDA 13: SGLang's install guide says its CUDA 12 images
# end with v0.5.19-cu129). SGLang pins its torch (2.14.1) and its CUDA
# kernels (sgl-kernel, flashinfer) are built against exactly that torch, so starting from
# it keeps SGLang's pin intact; Transformer Engine is then compiled against the
# same torch (--no-build-isolation), never pulling another torch, and megatron-core and this
# package then install beside it (setup.py's ranges accept that torch). (Not built on this project's CPU machines.)
FROM lmsysorg/sglang:v0.5.23

ARG TE_VERSION=2.10.0
# The GPU architectures Transformer Engine compiles for: 90 (H100/H200) unless the build says
# otherwise (docker build --build-arg NVTE_CUDA_ARCHS="90;100"); unset, TE compiles six, which
# multiplies the build's time.
ARG NVTE_CUDA_ARCHS=90
ENV PIP_NO_CACHE_DIR=1 \
    NVTE_FRAMEWORK=pytorch \
    NVTE_CUDA_ARCHS=${NVTE_CUDA_ARCHS} \
    MAX_JOBS=16

# bubblewrap + libseccomp2: the code sandbox (gspo_mcore/sandbox); g++ compiles C++ answers in it
# (reward.code.languages: cpp); its numpy and sympy are the image's own (torch needs sympy), bound
# read-only. Started by root in this image, bwrap needs `docker run --cap-add SYS_ADMIN --security-opt seccomp=unconfined --security-opt
# apparmor=unconfined` (gspo_mcore/sandbox/preflight.py DOCKER_FLAGS says why; a run that needs it
# and lacks one stops at start-up naming it).
RUN apt-get update && apt-get install -y --no-install-recommends curl git shellcheck bubblewrap libseccomp2 g++ \
    && rm -rf /var/lib/apt/lists/*

# Transformer Engine, built against the image's torch (grouped GEMM for the MoE experts). Its
# build files ask torch>=2.1 and nothing more (setup.py's setup_requirements): the PyTorch
# extension compiles against whichever torch is installed, here the image's 2.14.1.
# megatron-core 0.16.1 asks for transformer-engine[core_cu13,pytorch] >=2.9,<2.12; naming
# core_cu13 makes a CUDA 12 base fail here instead of at import (transformer_engine_torch
# picks its core library from torch.version.cuda).
RUN pip install --no-build-isolation "transformer-engine[core_cu13,pytorch]==${TE_VERSION}"

# No apex: nothing on the path this project runs uses it. megatron-core 0.16.1 imports
# Transformer Engine's FusedAdam / multi-tensor kernels first and apex's only when TE is
# missing (optimizer/__init__.py, optimizer.py, distrib_optimizer.py, clip_grads.py); the
# offloaded optimizer takes that same Adam and torch's AdamW on the host; the te spec normalises with
# TENorm (apex's FusedLayerNorm is the fallback without TE); gradient accumulation fusion,
# apex's other use, is off (models/qwen3_moe/model.py). Megatron's import-time "Apex is not
# installed" warning is harmless.

# vLLM (rollout.engine: vllm) in its own Python: vllm 0.33.0 pins torch 2.14.0, fastapi <0.137
# and xgrammar 0.2.8 (its wheel's metadata), SGLang's image has torch 2.14.1 and newer fastapi,
# so the two cannot share one environment; the engine is its own process anyway, started with
# rollout.engine_python (the vLLM configs name /opt/vllm/bin/python). uv makes the environment
# (the base's Python may lack the venv module). Its torch ships another NCCL than the trainer's:
# for NCCL pushes the server loads the trainer's (VLLM_NCCL_SO_PATH, set by
# gspo_mcore/engines/vllm/server.py). --build-arg WITH_VLLM=0 leaves it out (~10 GB less).
ARG WITH_VLLM=1
ARG VLLM_VERSION=0.33.0
RUN if [ "${WITH_VLLM}" = 1 ]; then \
        pip install uv \
        && uv venv --python "$(command -v python3)" /opt/vllm \
        && uv pip install --python /opt/vllm/bin/python "vllm==${VLLM_VERSION}" \
        && /opt/vllm/bin/python -c "import importlib.metadata as m; print('vllm', m.version('vllm'))"; \
    fi

# setup.py declares version ranges, so the image's torch (2.14.1) and SGLang's transformers and
# numpy satisfy them and stay; megatron-core at the version tested (constraints.txt).
COPY . /opt/gspo-mcore
# Checked without importing Transformer Engine: a build has no GPU driver, and TE's import loads
# libcuda (launch/smoke_1gpu.sh's first check imports it on a GPU).
RUN pip install -e /opt/gspo-mcore megatron-core==0.16.1 \
    && python -c "import torch; assert torch.__version__.startswith('2.14.1'), torch.__version__" \
    && python -c "import importlib.metadata as m; print('transformer-engine', m.version('transformer-engine'))" \
    && python -c "import gspo_mcore.config, gspo_mcore.planner.cli"
WORKDIR /opt/gspo-mcore
