"""Section 1: what this machine runs (Python, torch, transformers, CUDA, NCCL, the GPU), where
megatron-core came from, and whether Transformer Engine is here (without it the trainer's own
compat module binds what megatron-core 0.16.1 leaves unbound: gspo_mcore.megatron.te_compat)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def version_at_least(version: str, wanted: tuple[int, int]) -> bool:
    """"2.11.0+cu130" >= (2, 11); a version that does not parse is not."""
    try:
        return tuple(int(p) for p in version.split("+")[0].split(".")[:2]) >= wanted
    except ValueError:
        return False


def transformer_engine() -> dict:
    """TE's version (None: not importable) and, where the trainer has it, what its compat module
    reports binding without TE."""
    figures: dict = {"transformer_engine": None}
    if importlib.util.find_spec("transformer_engine") is not None:
        try:
            import transformer_engine

            figures["transformer_engine"] = getattr(transformer_engine, "__version__", "unknown")
        except Exception as err:  # noqa: BLE001 (present but broken: say how)
            figures["transformer_engine"] = f"not importable: {type(err).__name__}: {str(err)[:200]}"
    if importlib.util.find_spec("gspo_mcore.megatron.te_compat") is not None:
        figures["te_compat"] = te_compat_bindings()
    return figures


def te_compat_bindings() -> dict:
    """What the trainer's model build binds in megatron-core when TE is absent
    (te_compat.bind_missing_transformer_engine, called here as build_model calls it): the router's
    GEMM (None: its torch.mm path) and the TE version megatron-core then sees ("0": no TE feature)."""
    import megatron.core.utils as mcore_utils
    from megatron.core.transformer.moe import moe_utils

    from gspo_mcore.megatron import te_compat

    te_compat.bind_missing_transformer_engine()
    gemm = getattr(moe_utils, "te_general_gemm", "unbound")
    return {"moe_utils.te_general_gemm": "None (torch.mm)" if gemm is None else str(gemm)[:80],
            "megatron_te_version": str(getattr(mcore_utils, "_te_version", None))}


def section_1(check) -> dict:
    """In a child, as every section that imports megatron-core: the parent of a CPU run imports
    none of it (the fork server has)."""
    return check.child("gpucheck.environment:environment", wheel_paths=check.wheel_paths)


def environment(check, wheel_paths: int) -> dict:
    import torch
    import transformers

    import megatron.core

    figures = {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
               "megatron_core": getattr(megatron.core, "__version__", None),
               "megatron_from": str(Path(megatron.core.__file__).parents[2]), "cuda": torch.version.cuda,
               "device": check.device, "wheel_paths": wheel_paths, **transformer_engine()}
    if check.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        figures.update(gpu=props.name, gpu_uuid=str(props.uuid), gpu_memory_gb=props.total_memory / 2**30,
                       nccl=".".join(map(str, torch.cuda.nccl.version()[:3])))
        try:  # the library the weight push to vLLM binds (engines/vllm/nccl_library.py): torch's own, or not
            from gspo_mcore.engines.vllm import nccl

            figures["nccl_binding"] = ".".join(map(str, nccl.version()))
        except Exception as err:  # noqa: BLE001 (section 6 fails on it; this line only records it)
            figures["nccl_binding"] = f"{type(err).__name__}: {str(err)[:200]}"
    figures["pass"] = (version_at_least(torch.__version__, (2, 11))
                       and version_at_least(transformers.__version__, (5, 17)) and figures["megatron_core"] == "0.16.1")
    return figures
