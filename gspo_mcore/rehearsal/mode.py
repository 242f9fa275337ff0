"""The rehearsal's dispatch mode, entered above torch's FakeTensorMode: it sees every op the
production step runs (forward, backward, the recompute inside backward, the optimizer) first, and

1. refuses what a GPU refuses and fake kernels accept: a GEMM whose operands differ in dtype (the
   meta kernels of mm, addmm, bmm, baddbmm and F.linear check none), `_grouped_mm` offsets that are
   not int32 or not on the device; a device mix FakeTensorMode itself finds is re-raised the same
   way. Each as one line naming the op and the project line that called it (`Mismatch`);
2. answers the host reads (`.item()`, `.tolist()`, copies to the host) that a fake tensor has no
   value for: small tensors made from host values carry those values along (a shadow computed on
   the host beside the fake one: a count made on the host and all-reduced is this rank's own, as
   in a world of equal ranks); the dispatcher's token counts and the routing map's selections come
   from the routing plan (gspo_mcore.rehearsal.plan); anything else reads as zeros, and its line
   is listed (`unanswered`). Each read the host waits on the device for (a GPU sync: `.item()`, a
   truth test, a blocking copy to the host, an op whose output size is its input's values, a
   stream's, an event's or the device's synchronize) is counted by line (`host_waits`);
3. runs ops on host tensors that never met the device for real (index tensors megatron builds on
   the host, the host RNG's state checks);
4. pins host memory as a GPU build would (a copy, counted as host memory: an offloaded optimizer's);
5. counts the device's live storages (gspo_mcore.rehearsal.memory) and the FLOPs by kind
   (gspo_mcore.rehearsal.flops).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map_only
from torch.utils.weak import WeakTensorKeyDictionary

from gspo_mcore.rehearsal import device as fake_device
from gspo_mcore.rehearsal.plan import RoutingPlan

aten = torch.ops.aten
SHADOW_NUMEL = 4096  # tensors up to this size made from host values carry them
READ_NUMEL = 1 << 20  # device tensors up to this size copied to the host are read there (get values)
_GEMMS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.linear.default,
          aten.matmul.default}
# Collectives after which a rank's tensor holds its own value in a world of equal ranks.
_KEEPS_VALUES = {"allreduce_", "broadcast_", "all_reduce", "all_reduce_"}
_UNINITIALIZED = {aten.empty, aten.empty_strided, aten.new_empty, aten.new_empty_strided, aten.empty_like}
_HOST_READS = {aten._local_scalar_dense.default}
# Ops whose output size is their input's values: on a GPU the host waits for them to know it.
_SIZED_BY_VALUES = {aten.nonzero.default, aten.masked_select.default, aten._unique2.default,
                    aten.unique_consecutive.default, aten.unique_dim.default}
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[1])  # gspo_mcore/
_REPO = str(Path(_PACKAGE_ROOT).parent)
_REHEARSAL = str(Path(__file__).resolve().parent)
_SKIPPED = (str(Path(torch.__file__).parent), _REHEARSAL, str(Path(contextlib.__file__).parent) + "/")


class Mismatch(RuntimeError):
    """A device or dtype slip a GPU would raise: one line, the op and the project line."""


def _is_caller(filename: str) -> bool:
    """A frame of the code being rehearsed: not torch's, the standard library's or the rehearsal's."""
    return not filename.startswith(_SKIPPED) and not filename.startswith("<")


def _shown(filename: str) -> str:
    if "/site-packages/" in filename:
        return filename.split("/site-packages/", 1)[1]
    return filename[len(_REPO) + 1:] if filename.startswith(_REPO + "/") else filename


def project_line(depth_limit: int = 80) -> str:
    """The innermost caller outside torch, the standard library and the rehearsal (this project's,
    megatron-core's) as path:line; in backward with none, the autograd node running."""
    frame = sys._getframe(2)
    for _ in range(depth_limit):
        if frame is None:
            break
        if _is_caller(frame.f_code.co_filename):
            return f"{_shown(frame.f_code.co_filename)}:{frame.f_lineno}"
        frame = frame.f_back
    node = torch._C._current_autograd_node()
    return f"autograd {node.name()}" if node is not None else "torch"


def project_function(depth_limit: int = 80) -> str | None:
    """The innermost caller in this project (outside the rehearsal) as path:function."""
    frame = sys._getframe(2)
    for _ in range(depth_limit):
        if frame is None:
            return None
        name = frame.f_code.co_filename
        if name.startswith(_PACKAGE_ROOT) and not name.startswith(_REHEARSAL):
            return f"{Path(name).relative_to(Path(_PACKAGE_ROOT).parent)}:{frame.f_code.co_name}"
        frame = frame.f_back
    return None


def _find_frame(function_name: str, depth_limit: int = 40):
    frame = sys._getframe(2)
    for _ in range(depth_limit):
        if frame is None:
            return None
        if frame.f_code.co_name == function_name:
            return frame
        frame = frame.f_back
    return None


class FakeCuda(FakeTensorMode):
    """FakeTensorMode as on a machine without CUDA (`avoid_device_init`: torch.tensor(..., device=
    "cuda") is made on the host and lifted; no constant folding through a device move) although
    torch.cuda answers as an H100 here (gspo_mcore.rehearsal.device)."""

    @property
    def avoid_device_init(self) -> bool:
        return True


class Rehearsal(TorchDispatchMode):
    def __init__(self, plan: RoutingPlan, counters: dict, flops=None, answers: dict | None = None):
        """`answers`: host reads answered by the project function that makes them (path:function ->
        the value every element reads as)."""
        super().__init__()
        self.plan, self.counters, self.flops, self.answers = plan, counters, flops, answers or {}
        self.shadows = WeakTensorKeyDictionary()
        self.pinned = WeakTensorKeyDictionary()  # host tensors pinned (a CPU build has no pinned allocator)
        self.unanswered: dict[str, int] = {}
        self.blocking_copies: dict[str, int] = {}  # host-to-device copies the host waits on, by line
        self.host_waits: dict[str, int] = {}  # device-to-host reads the host waits on (GPU syncs), by line
        self._listing = False  # inside a fake tensor's .tolist(): its element reads are one wait

    def __enter__(self):
        fake_device.host_wait_listeners.append(self._note_synchronize)
        self._tolist = FakeTensor.tolist  # torch's: an .item() per element
        FakeTensor.tolist = lambda tensor: self._one_wait_tolist(tensor)  # a function: bound per tensor
        return super().__enter__()

    def __exit__(self, *exc):
        fake_device.host_wait_listeners.remove(self._note_synchronize)
        FakeTensor.tolist = self._tolist
        return super().__exit__(*exc)

    def _one_wait_tolist(self, tensor):
        """A fake tensor's .tolist() reads element by element; a GPU's is one copy, one wait."""
        if tensor.device.type != "cuda" or self._listing:
            return self._tolist(tensor)
        self._note_wait(project_line())
        self._listing = True
        try:
            return self._tolist(tensor)
        finally:
            self._listing = False

    # ------------------------------------------------------------ dispatch

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        fakes = [t for t in flat if isinstance(t, FakeTensor)]
        if func in (aten._pin_memory.default, aten.pin_memory.default):  # a CPU build has no pinned allocator
            if fakes:
                pinned = aten.clone.default(args[0])  # page-locked host memory: a copy there
                self._count(func, args, kwargs, pinned)
            else:
                with _disable_current_modes():
                    pinned = args[0].clone()
            self.pinned[pinned] = True
            return pinned
        if func is aten.is_pinned.default:
            return args[0] in self.pinned
        if not fakes and self._host_only(func, flat, kwargs):
            with _disable_current_modes():
                return func(*args, **kwargs)
        if func in _GEMMS or func is aten._grouped_mm.default:
            self._check_gemm(func, args, kwargs)
        self._note_blocking_copy(func, args, kwargs)
        self._note_host_wait(func, args, kwargs)
        if func in _HOST_READS:
            return self._scalar(args[0])
        if func is aten._to_copy.default and _to_host(args[0], kwargs) and self._readable(args[0]):
            return self._host_copy(args[0], kwargs.get("dtype"))
        if func is aten.copy_.default and _is_host(args[0]) and isinstance(args[1], FakeTensor) \
                and args[1].device.type == "cuda":  # into a real host tensor: it gets values
            with _disable_current_modes():
                return args[0].copy_(self._host_copy(args[1], args[0].dtype))
        if func is aten.masked_select.default:
            out = self._masked_select(args[0], args[1])
            if out is not None:
                return out
        try:
            out = func(*args, **kwargs)
        except Mismatch:
            raise
        except Exception as error:
            message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            if "device" in message.lower() or "Unhandled FakeTensor" in message:
                raise Mismatch(f"{func.__name__} at {project_line()}: {message}") from None
            raise
        self._shadow(func, args, kwargs, out)
        self._count(func, args, kwargs, out)
        return out

    @staticmethod
    def _host_only(func, flat, kwargs) -> bool:
        """Host tensors in, no device asked for: run it for real. A factory with no tensor input is
        faked (on the host too: the model's parameters made there, megatron's router weight)."""
        device = kwargs.get("device")
        if device is not None and torch.device(device).type != "cpu":
            return False
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        return bool(tensors) and all(t.device.type == "cpu" for t in tensors)

    # ------------------------------------------------------------ checks

    def _check_gemm(self, func, args, kwargs) -> None:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if func is aten._grouped_mm.default:
            offsets = args[2] if len(args) > 2 else kwargs.get("offs")
            if offsets is not None:
                if offsets.dtype != torch.int32:
                    raise Mismatch(f"_grouped_mm at {project_line()}: offsets are {offsets.dtype}, a GPU takes "
                                   "int32 only")
                if offsets.device != tensors[0].device:
                    raise Mismatch(f"_grouped_mm at {project_line()}: offsets on {offsets.device}, operands on "
                                   f"{tensors[0].device}")
            tensors = tensors[:2]
        dtypes = {t.dtype for t in tensors}
        if len(dtypes) > 1:
            names = " x ".join(str(t.dtype).replace("torch.", "") for t in tensors)
            raise Mismatch(f"{func.__name__} at {project_line()}: operands {names}; a GPU refuses mixed dtypes")
        devices = {t.device for t in tensors if t.dim() > 0}
        if len(devices) > 1:
            raise Mismatch(f"{func.__name__} at {project_line()}: operands on {' and '.join(map(str, devices))}")

    # ------------------------------------------------------------ host reads

    def _scalar(self, tensor):
        shadow = self.shadows.get(tensor) if isinstance(tensor, FakeTensor) else tensor
        if shadow is not None:
            with _disable_current_modes():
                return shadow.item()
        answer = self.answers.get(project_function())
        if answer is not None:
            return answer
        shape = self._pipeline_shape()
        if shape is not None:
            return int(shape[tensor.storage_offset()])  # `.tolist()` reads element by element
        self._note_unanswered()
        return False if tensor.dtype == torch.bool else (0 if not tensor.dtype.is_floating_point else 0.0)

    def _readable(self, tensor) -> bool:
        """A copy to the host gets values (is read) up to READ_NUMEL: a count, a flag, a probe's
        log-probs. A larger one (an offloaded optimizer's parameters) stays a fake host tensor,
        counted as host memory."""
        return tensor.numel() <= READ_NUMEL

    def _host_copy(self, tensor, dtype):
        """A device tensor read on the host: its shadow, the plan's counts, or zeros."""
        dtype = dtype or tensor.dtype
        shadow = self.shadows.get(tensor)
        if shadow is None:
            shadow = self._dispatcher_counts(tensor)
        answer = self.answers.get(project_function())
        if shadow is None and answer is not None:
            with _disable_current_modes():
                return torch.full(tensor.shape, answer, dtype=dtype)
        if shadow is None:
            self._note_unanswered()
            with _disable_current_modes():
                return torch.zeros(tensor.shape, dtype=dtype)
        with _disable_current_modes():
            return shadow.to(dtype=dtype).clone()

    def _dispatcher_counts(self, tensor):
        mover = _find_frame("maybe_move_tensor_to_cpu")
        caller = mover.f_back if mover is not None else None
        dispatcher = caller.f_locals.get("self") if caller is not None else None
        if dispatcher is None or not hasattr(dispatcher, "routing_map"):
            return None
        counts = self.plan.dispatcher_counts(int(dispatcher.routing_map.shape[0]))
        candidates = {name: getattr(dispatcher, name, None) for name in counts}
        candidates["tokens_per_expert"] = caller.f_locals.get("tokens_per_expert")
        for name, value in candidates.items():
            if value is tensor:
                with _disable_current_modes():
                    return torch.from_numpy(np.ascontiguousarray(counts[name])).reshape(tensor.shape)
        return None

    @staticmethod
    def _pipeline_shape():
        """The activation shape a pipeline stage receives (megatron's p2p_communication.py
        `_communicate_shapes`, variable sequence lengths: the shapes travel first): in a world of
        equal stages, the shape `_communicate` expects for this microbatch (its `tensor_shape`)."""
        frame = _find_frame("_communicate_shapes")
        caller = frame.f_back if frame is not None else None
        return caller.f_locals.get("tensor_shape") if caller is not None else None

    def _masked_select(self, source, mask):
        count = self.plan.masked_count(tuple(mask.shape))
        if count is None:
            return None
        return torch.empty(count, dtype=source.dtype, device=source.device)

    def _note_blocking_copy(self, func, args, kwargs) -> None:
        """A host-to-device copy from pageable memory, or without non_blocking, holds the host until
        the stream has run everything queued before it (cudaMemcpy's pageable path): a sync."""
        source, destination, non_blocking = _copy_of(func, args, kwargs)
        if destination == "cuda" and source.device.type == "cpu" and not (non_blocking and source in self.pinned):
            line = project_line()
            self.blocking_copies[line] = self.blocking_copies.get(line, 0) + 1

    def _note_host_wait(self, func, args, kwargs) -> None:
        """A read of a device tensor's values the host waits for: a scalar, a copy to the host (real or
        fake host memory) without non_blocking (with it, the copy is queued and read after a sync
        elsewhere), an op sized by its input's values (repeat_interleave without output_size too)."""
        source, destination, non_blocking = _copy_of(func, args, kwargs)
        if destination is not None:
            waits = destination == "cpu" and not non_blocking
        elif func is aten.repeat_interleave.Tensor:
            waits = kwargs.get("output_size") is None
        else:
            waits = func in _HOST_READS or func in _SIZED_BY_VALUES
        if waits and not self._listing and isinstance(source, FakeTensor) and source.device.type == "cuda":
            self._note_wait(project_line())

    def _note_synchronize(self) -> None:
        self._note_wait(project_line())

    def _note_wait(self, line: str) -> None:
        self.host_waits[line] = self.host_waits.get(line, 0) + 1

    def _note_unanswered(self) -> None:
        line = project_line()
        self.unanswered[line] = self.unanswered.get(line, 0) + 1

    # ------------------------------------------------------------ shadows and counts

    def _shadow(self, func, args, kwargs, out) -> None:
        """Values of small tensors made from host values, computed beside the fake ones."""
        if func.namespace in ("c10d", "_c10d_functional"):
            if func.__name__.split(".")[0] not in _KEEPS_VALUES:  # another rank's data lands here
                for t in tree_flatten((args, kwargs))[0]:
                    if isinstance(t, FakeTensor):
                        self.shadows.pop(t, None)
            return
        if torch.Tag.nondeterministic_seeded in func.tags or func.overloadpacket in _UNINITIALIZED:
            return
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, FakeTensor)]
        if not outs or any(t.numel() > SHADOW_NUMEL for t in outs):
            return
        flat = tree_flatten((args, kwargs))[0]
        inputs = [t for t in flat if isinstance(t, torch.Tensor)]
        if any(isinstance(t, FakeTensor) and t not in self.shadows for t in inputs):
            return
        as_host = lambda t: self.shadows[t] if isinstance(t, FakeTensor) else t  # noqa: E731
        host_args, host_kwargs = tree_map_only(torch.Tensor, as_host, (args, kwargs))
        if "device" in host_kwargs:
            host_kwargs = {**host_kwargs, "device": "cpu"}
        try:
            with _disable_current_modes():
                values = func(*host_args, **host_kwargs)
        except Exception:
            return
        for fake, value in zip(outs, [v for v in tree_flatten(values)[0] if isinstance(v, torch.Tensor)]):
            self.shadows[fake] = value

    def _count(self, func, args, kwargs, out) -> None:
        site = None
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, FakeTensor):
                continue
            counter = self.counters.get(tensor.device.type)
            if counter is None:
                continue
            storage = tensor.untyped_storage()
            if storage._cdata not in counter.entries:
                if site is None:
                    site = f"{project_line()} ({func.__name__})"
                counter.register(storage, site)
        if self.flops is not None:
            self.flops.count(func, args, kwargs, out)


def _is_host(tensor) -> bool:
    return isinstance(tensor, torch.Tensor) and not isinstance(tensor, FakeTensor) and tensor.device.type == "cpu"


def _copy_of(func, args, kwargs) -> tuple:
    """(source, the destination's device type, non_blocking) of a copy across devices (`_to_copy`
    with a device, `copy_`); for any other op (its first argument, None, False)."""
    if func is aten._to_copy.default and kwargs.get("device") is not None:
        return args[0], torch.device(kwargs["device"]).type, kwargs.get("non_blocking", False)
    if func is aten.copy_.default:
        return args[1], args[0].device.type, (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
    return (args[0] if args else None), None, False


def _to_host(tensor, kwargs) -> bool:
    device = kwargs.get("device")
    return isinstance(tensor, FakeTensor) and tensor.device.type == "cuda" and device is not None \
        and torch.device(device).type == "cpu"


def _data_keeps_device() -> None:
    """`tensor.data = other` on a fake tensor swaps the implementation (TensorBase.data's setter,
    not an op any mode sees) and keeps the old fake device: a parameter built on the host and put
    in DDP's device buffer (megatron's router weight, router.py) kept reporting the host. The
    setter here carries the new data's device over."""
    base = torch._C.TensorBase.data

    def set_data(self, value):
        base.__set__(self, value)
        if isinstance(value, FakeTensor):
            self.fake_device = value.fake_device

    FakeTensor.data = property(base.__get__, set_data)


_data_keeps_device()


@contextlib.contextmanager
def rehearsed(plan: RoutingPlan, counters: dict | None = None):
    """Fake CUDA tensors and the rehearsal's checks around a block (the fake devices loaded first:
    gspo_mcore.rehearsal.device.load); yields the mode (its `unanswered` reads)."""
    fake, mode = FakeCuda(allow_non_fake_inputs=True), Rehearsal(plan, counters or {})
    with fake, mode:
        yield mode
