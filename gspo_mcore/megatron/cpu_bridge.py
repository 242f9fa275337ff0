"""Run the real megatron-core 0.16.1 on a CPU-only machine with gloo.

Megatron assumes CUDA in a handful of places (measured list:
shared/notes/megatron-core-on-cpu.md). `install()` bridges each of them so that the real
GPTModel, MoE router and dispatchers, DDP, distributed optimizer, 1F1B schedule and
dist_checkpointing run unchanged. Imported only by the CPU path and tests: the GPU path
never calls it, so nothing here can change GPU numerics.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from gspo_mcore.megatron import _compiler_disabled
from gspo_mcore.megatron.te_compat import bind_missing_transformer_engine

_installed = False


class _CudaDeviceToCpu(TorchFunctionMode):
    """Factory calls with a literal device="cuda"/"cuda:N" (e.g. causal masks in
    transformer/utils.py, buffers in clip_grads.py) get device="cpu"."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


class _NoStream:
    """Stands in for torch.cuda.Stream/Event: CPU work is already synchronous."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args):
        pass

    def wait_event(self, *args):
        pass

    def record_event(self, *args):
        return _NoStream()

    def record(self, *args):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _all_to_all_single_with_int_splits(original):
    # gloo's binding wants Python int lists; Megatron passes tensors / numpy arrays.
    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, **kwargs):
        to_list = lambda s: None if s is None else [int(x) for x in s]  # noqa: E731
        return original(output, input, to_list(output_split_sizes), to_list(input_split_sizes), **kwargs)

    return all_to_all_single


def _type_reporting_cuda(original):
    # Megatron's optimizers and grad clipping check `tensor.type()` against 'torch.cuda.*Tensor'
    # names; report CPU tensors under those names (only the no-argument query form).
    def tensor_type(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = original(self)  # may already be rewritten: the function mode re-dispatches here
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        return original(self, dtype, non_blocking, **kwargs)

    return tensor_type


def _optimizers_without_dynamo() -> None:
    """torch.optim imports TorchDynamo (~1.2 s of CPU; every CPU rank paid it in Megatron's optimizer
    setup and first step) only to keep its functions from being compiled and to break the graph
    around `step`, where TorchDynamo is disabled (TORCH_COMPILE_DISABLE=1) and nothing is compiled:
    - `torch._disable_dynamo` (torch/_compile.py) wraps add_param_group, zero_grad, state_dict, ...
      and each optimizer's functional step; its first call imports TorchDynamo to make the disabled
      function and caches it on the function (`__dynamo_disable`): that cache is filled here with
      the function itself, what TorchDynamo's disable runs when nothing compiles;
    - `_use_grad_for_differentiable` (torch/optim/optimizer.py) wraps each optimizer's `step`: it
      sets grad mode to the optimizer's `differentiable` around the step between two
      `torch._dynamo.graph_break()`s, no-ops outside compiled code: here the same grad mode without
      them.
    Wrappers of another shape are left as they are (they import TorchDynamo as before). Called
    before TorchDynamo is imported (`install`)."""
    from torch.optim import optimizer

    disable_code = torch._disable_dynamo(lambda: None).__code__
    use_grad_code = optimizer._use_grad_for_differentiable(lambda self: None).__code__

    def fill(function, depth=0) -> None:
        code = getattr(function, "__code__", None)
        if code is None or depth > 2:
            return
        cells = dict(zip(code.co_freevars, function.__closure__ or ()))
        if code is disable_code:
            wrapped = cells["fn"].cell_contents
            wrapped.__dynamo_disable = wrapped
            return
        for cell in cells.values():  # _disable_dynamo_if_unsupported's wrapper holds one
            try:
                fill(cell.cell_contents, depth + 1)
            except ValueError:  # an empty cell
                pass

    for name, module in list(sys.modules.items()):
        if not name.startswith("torch.optim") or module is None:
            continue
        for value in vars(module).values():
            if not isinstance(value, type):
                fill(value)
                continue
            for member in vars(value).values():
                fill(getattr(member, "__func__", member))
            step = value.__dict__.get("step")
            if issubclass(value, optimizer.Optimizer) and getattr(step, "__code__", None) is use_grad_code:
                value.step = _in_grad_mode_of_differentiable(step.__wrapped__)


def _in_grad_mode_of_differentiable(step):
    @functools.wraps(step)
    def in_grad_mode(self, *args, **kwargs):
        before = torch.is_grad_enabled()
        try:
            torch.set_grad_enabled(self.defaults["differentiable"])
            return step(self, *args, **kwargs)
        finally:
            torch.set_grad_enabled(before)

    return in_grad_mode


def _on_cpu(function):
    """`function` with its literal device="cuda" factories made on the CPU, in any thread."""
    def on_cpu(*args, **kwargs):
        with _CudaDeviceToCpu():
            return function(*args, **kwargs)
    return on_cpu


def install() -> None:
    """Idempotent. Call before building any Megatron module."""
    global _installed
    if _installed:
        return
    _installed = True
    if torch.cuda.is_available():
        raise RuntimeError("cpu_bridge.install() called on a machine with CUDA: use the GPU path")

    # The function mode below sees Megatron read parameters' `.grad` through tensor views and torch
    # then warns of a non-leaf's `.grad`: harmless here (the gradients are the leaves'), once a run.
    warnings.filterwarnings("ignore", message=r"The \.grad attribute of a Tensor that is not a leaf Tensor",
                            category=UserWarning)
    # megatron-core 0.16.1's `tensor.storage()` (param_and_grad_buffer.py: the grad buffers given
    # back and taken again) through the function mode below: torch's TypedStorage deprecation,
    # attributed to this module, once a run and before the run's own last line (a bad input's
    # one-line error became three). Only what this module passes on; a user's own stays shown.
    warnings.filterwarnings("ignore", message=r"TypedStorage is deprecated", category=UserWarning,
                            module=r"gspo_mcore\.megatron\.cpu_bridge")

    # Megatron decorates small fused functions with torch.compile; on CPU that would
    # compile C++ kernels at first call for no gain. TorchDynamo reads the variable when it is
    # imported (megatron.core's import no longer does: gspo_mcore.megatron), else its config.
    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
    if "torch._dynamo" in sys.modules:
        torch._dynamo.config.disable = True
    elif _compiler_disabled():
        _optimizers_without_dynamo()

    cuda = torch.cuda
    cuda.current_device = lambda: "cpu"
    cuda.synchronize = lambda *a, **k: None
    cuda.Stream = _NoStream
    cuda.Event = _NoStream
    cuda.current_stream = lambda *a, **k: _NoStream()
    cuda.stream = lambda *a, **k: _NoStream()
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(seed)
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.Tensor.type = _type_reporting_cuda(torch.Tensor.type)
    dist.all_to_all_single = _all_to_all_single_with_int_splits(dist.all_to_all_single)
    _CudaDeviceToCpu().__enter__()  # stays on the mode stack for the process

    # After torch.cuda is bridged: these modules read it at import.
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as mcore_random

    # The causal masks, also where the mode above is not on the stack: activation recompute runs
    # the layer again inside autograd's backward (model.recompute: full).
    for name in ("get_default_causal_mask", "get_sliding_window_causal_mask"):
        setattr(fused_softmax, name, _on_cpu(getattr(fused_softmax, name)))
    mcore_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    # Not a CPU matter: what megatron-core leaves unbound without Transformer Engine, bound as on a GPU.
    bind_missing_transformer_engine()
