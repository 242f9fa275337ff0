from setuptools import find_packages, setup

# torch is pinned to the CPU wheel used on development/CI machines; the GPU image
# (Dockerfile) installs its own CUDA build of torch before this package.
INSTALL_REQUIRES = [
    "torch==2.13.0",
    "megatron-core==0.16.1",
    "transformers==5.19.0",  # the release SGLang 0.5.23 is known to run with
    "safetensors==0.8.0",
    "pyyaml==6.0.3",
    "sentencepiece==0.2.3",
    "psutil==7.2.2",  # dist_checkpointing needs it; megatron-core does not declare it
    "numpy==2.3.5",  # numba (SGLang's CPU server) needs numpy < 2.4
    "math-verify==0.9.0",  # the math answer reward
    "pyarrow==26.0.1",  # Parquet prompt datasets
    "tensorboard==2.20.0",  # metrics event files
    "matplotlib==3.11.2",  # python -m gspo_mcore.plot
]

setup(
    name="gspo-mcore",
    version="0.1.0",
    description="Megatron-Core backend for GSPO reinforcement learning of Qwen3-MoE models",
    python_requires=">=3.11",
    packages=find_packages(include=["gspo_mcore", "gspo_mcore.*", "checkpoint_convert", "checkpoint_convert.*"]),
    entry_points={"console_scripts": ["gspo-train = gspo_mcore.train:cli"]},
    package_data={"gspo_mcore": ["data/samples/*.jsonl"]},
    install_requires=INSTALL_REQUIRES,
    extras_require={
        "gpu": ["transformer-engine[core_cu13,pytorch]==2.10.0", "sglang==0.5.23"],
        "test": ["pytest==9.2.0"],
    },
)
