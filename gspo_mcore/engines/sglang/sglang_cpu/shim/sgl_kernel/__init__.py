"""Stand-in for `sgl_kernel` (CUDA-only wheel) on the CPU SGLang server: SGLang imports names
from it at start-up but, on the CPU/torch_native path, calls none of them."""


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def not_available(*args, **kwargs):
        raise RuntimeError(f"sgl_kernel.{name} was called: it has no CPU implementation (CPU SGLang shim)")

    not_available.__name__ = name
    return not_available
