"""Loaded by every Python process of a CPU SGLang server (the shim directory is on its
PYTHONPATH; SGLang spawns its scheduler and detokenizer, so a patch in the launcher alone
would not reach them).

`--enable-return-routed-experts` allocates its host buffer through
`sglang.srt.mem_cache.pool_host.common.ALLOC_MEMORY_FUNCS[device]`, which has no "cpu" entry
in 0.5.23: it falls back to pinning with cudaHostRegister (`torch.cuda.cudart()`), and the
server dies at start-up without CUDA. On CPU the buffer is plain memory; the entry is added
when that module is first imported. Nothing else of the capturer needs CUDA on CPU (measured:
the routed experts of a tiny model matched a transformers forward, expert order included).
"""

import importlib.abc
import os
import sys

_MODULE = "sglang.srt.mem_cache.pool_host.common"


def _plain_host_buffer(dims, dtype, device, pin_memory, allocator=None, **_):
    import torch

    return torch.zeros(dims, dtype=dtype, device="cpu")


class _AddCpuAllocator(importlib.abc.MetaPathFinder):
    """Wraps the module's loader so that the entry is added right after it executes."""

    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            module.ALLOC_MEMORY_FUNCS.setdefault("cpu", _plain_host_buffer)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
    sys.meta_path.insert(0, _AddCpuAllocator())
