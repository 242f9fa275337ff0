"""A real SGLang 0.5.23 server on a CPU-only machine (tests and the CPU default only).

What it takes (measured; shared/notes/sglang-on-cpu.md):
- `requirements.txt` beside this file, installed with `pip install --no-deps` after torch
  2.13.0 (CPU): SGLang's own requirements would replace torch with a CUDA 2.14.1 build.
- torchvision 0.28.0 (in that list) is a CUDA build whose C ops do not load with the CPU
  torch; `python -m gspo_mcore.engines.sglang.sglang_cpu.patch_torchvision` makes it import its
  op registrations only when the ops exist (idempotent).
- There is no CPU `sgl_kernel` wheel: `shim/sgl_kernel` is a stand-in put on the server's
  PYTHONPATH only; its names resolve lazily and raise if ever called.
- `SGLANG_USE_CPU_ENGINE=1` with `--device cpu`, the torch_native attention backend.
- SGLang's Qwen3-MoE ignores `mlp_only_layers` (dense layers): serve all-MoE models only
  (the real Qwen3-MoE checkpoints are).
- Its model registry imports every module of sglang.srt.models (~250) at start-up; the server
  env names all but Qwen3-MoE's in SGLANG_DISABLED_MODEL_ARCHS (sglang/srt/models/registry.py
  import_model_classes skips them): measured 10.8 -> 7.8 s of CPU per server start.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

SHIM = Path(__file__).resolve().parent / "shim"


SERVED_MODEL_MODULE = "qwen3_moe"


def unserved_model_modules() -> list[str]:
    """The modules of the installed sglang.srt.models but Qwen3-MoE's, found without importing SGLang."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return []
    models = Path(next(iter(spec.submodule_search_locations))) / "srt" / "models"
    return sorted(p.stem for p in models.glob("*.py") if p.stem not in (SERVED_MODEL_MODULE, "__init__", "registry"))


def server_env(base: dict | None = None) -> dict:
    env = dict(os.environ if base is None else base)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    env["TORCH_COMPILE_DISABLE"] = "1"  # nothing compiled on CPU (shim/sitecustomize.py)
    if "SGLANG_DISABLED_MODEL_ARCHS" not in env:  # a user's own list is kept
        env["SGLANG_DISABLED_MODEL_ARCHS"] = ",".join(unserved_model_modules())
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SHIM), env.get("PYTHONPATH", "")) if p)
    return env
