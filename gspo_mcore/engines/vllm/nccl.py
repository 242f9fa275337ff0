"""The trainer's end of vLLM's NCCL weight transfer (the "nccl" backend of
vllm/distributed/weight_transfer/, its unique-id rendezvous: nccl_common.decode_nccl_unique_id,
pynccl.PyNcclCommunicator.from_unique_id_bytes) without vLLM in the trainer's Python: a raw NCCL
communicator from a unique id we make, through our own ctypes binding (nccl_library: torch's
`torch.cuda.nccl.init_rank` raises SystemError on CPython 3.10-3.12). vLLM's workers are ranks
1..tp, we are rank 0, the broadcast's root. CUDA only; the engine calls these through this module
so a test can stand in for them."""

from __future__ import annotations

import contextlib
import importlib.util
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from gspo_mcore.engines.vllm import nccl_library
from gspo_mcore.engines.vllm.nccl_library import NCCLError

_LOADED: list[nccl_library.Library] = []  # this process's, loaded once
_LOCK = threading.Lock()
# vLLM gives its own abort this long before moving on (PyNcclCommunicator.destroy, pynccl.py).
ABORT_WAIT_S = 5.0
# vLLM 0.33's NCCLLibrary (pynccl_wrapper.py) binds ncclCommSuspend / ncclCommResume on CUDA and raises
# without them: "NCCL >= 2.29.7 does, and vLLM's CUDA path already requires that version".
VLLM_NEEDS = (2, 29, 7)
POLL_S = 0.002  # between looks at a broadcast in flight (a bucket's takes ~10-100 ms)


def loaded() -> nccl_library.Library:
    """The libnccl this process binds (nccl_library.load: VLLM_NCCL_SO_PATH, else the one torch
    loaded, else the nvidia-nccl wheel's), loaded on first use."""
    with _LOCK:
        if not _LOADED:
            _LOADED.append(nccl_library.load(wheel=library()))
        return _LOADED[0]


def unique_id() -> bytes:
    """ncclGetUniqueId: 128 bytes naming our bootstrap address (NCCL_SOCKET_IFNAME applies)."""
    return loaded().unique_id()


def current_device() -> int:
    """The CUDA device of the calling thread (the rank's: torch.cuda.set_device at start)."""
    return torch.cuda.current_device()


@dataclass
class WeightGroup:
    """Our end of one server's communicator: the raw NCCL communicator (`comm`, its handle), the
    device it is bound to, and the stream its broadcasts run on, apart from the trainer's: a
    broadcast the server never receives (it refused the bucket) then waits there, not in front of
    the trainer's later work. Ended by `close` (ncclCommAbort: it waits for no peer, so a server
    that left cannot block it)."""
    comm: int
    stream: object  # torch.cuda.Stream
    device: int
    library: nccl_library.Library
    closed: bool = False
    pending: list = field(default_factory=list)  # torch.cuda.Event of each broadcast not yet seen done


def communicator(world_size: int, uid: bytes, device: int) -> WeightGroup:
    """ncclCommInitRank as rank 0 on `device` (blocks, without the GIL, until every worker
    joined), then the one-element float32 all-reduce every vLLM worker issues right after its own
    init (pynccl.py PyNcclCommunicator._init_comm: a peer that skips it deadlocks them all).
    Called on a thread of its own: a new thread starts on CUDA device 0, and NCCL binds the
    communicator to the calling thread's device."""
    library = loaded()
    torch.cuda.set_device(device)
    comm = library.comm_init_rank(world_size, uid, 0)
    group = WeightGroup(comm, torch.cuda.Stream(device=device), device, library)
    try:
        warm_up = torch.zeros(1, dtype=torch.float32, device=torch.device("cuda", device))
        group.stream.wait_stream(torch.cuda.current_stream(device))  # the zeros are written
        library.all_reduce(warm_up.data_ptr(), 1, "float32", comm, group.stream.cuda_stream)
        group.stream.synchronize()
    except BaseException:
        with contextlib.suppress(NCCLError):  # the warm-up's error is the one to see
            close(group)  # a communicator half made is not left behind
        raise
    return group


def broadcast(group: WeightGroup, flat: torch.Tensor) -> None:
    """ncclBroadcast of `flat` from us (root 0) on the group's stream, after the work queued so far
    on the current stream (what wrote `flat`); returns before it moves. `flat`'s memory is not
    reused until the broadcast ran (record_stream)."""
    if group.closed:
        raise NCCLError("ncclBroadcast on a closed weight group")
    if flat.device != torch.device("cuda", group.device):  # as vLLM's PyNcclCommunicator.broadcast asserts
        raise NCCLError(f"ncclBroadcast of a tensor on {flat.device} in a group on cuda:{group.device}")
    group.stream.wait_stream(torch.cuda.current_stream(flat.device))
    flat.record_stream(group.stream)
    group.library.broadcast(flat.data_ptr(), flat.numel(), str(flat.dtype).removeprefix("torch."), 0, group.comm,
                            group.stream.cuda_stream)
    done = torch.cuda.Event()
    done.record(group.stream)
    group.pending.append(done)


def wait(group: WeightGroup, server: str, timeout_s: float, stop: Callable[[], str | None] = lambda: None,
         clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
    """Until the group's broadcasts ran, looking every POLL_S at their events (cudaEventQuery, no
    spin on the device) and at the communicator's asynchronous error; `stop()` says why to give up
    (the server refused the bucket: its receive never comes). A worker that died mid-broadcast
    leaves the kernel spinning for ever, and a torch.cuda.synchronize behind it with it: on an
    NCCL error, `stop`, or `timeout_s` the communicator is aborted first (the kernel ends), then one
    line naming the server."""
    deadline = clock() + timeout_s
    while True:
        state = group.library.async_error(group.comm)
        if state not in (nccl_library.SUCCESS, nccl_library.IN_PROGRESS):
            why = f"failed: {group.library.reason(state)} (ncclResult_t {state})"
        elif all(event.query() for event in group.pending):
            group.pending.clear()
            return
        elif (reason := stop()) is not None:
            why = f"abandoned: {reason}"
        elif clock() > deadline:
            why = f"not complete after {timeout_s:g} s (a worker gone?)"
        else:
            sleep(POLL_S)
            continue
        break
    aborted = "its communicator aborted"
    try:
        close(group)
    except NCCLError as err:
        aborted = f"aborting its communicator failed too: {err}"
    raise NCCLError(nccl_library.one_line(f"server {server}: the NCCL weight broadcast {why}; {aborted}"))


def close(group: WeightGroup, wait_s: float = ABORT_WAIT_S) -> None:
    """ncclCommAbort of the group's communicator, once (again: nothing): its memory and threads go
    back whether or not the server is still there, so a reopen leaks nothing. On a daemon thread
    bound to the group's device, waited for `wait_s`, as vLLM's PyNcclCommunicator.destroy does:
    an abort that hangs must not keep the trainer (or its exit) waiting."""
    if group.closed:
        return
    group.closed = True
    outcome: dict = {}

    def abort() -> None:
        try:
            if torch.cuda.is_available():
                torch.cuda.set_device(group.device)
            group.library.comm_abort(group.comm)
        except BaseException as err:  # noqa: BLE001 (re-raised on the caller's thread)
            outcome["error"] = err

    thread = threading.Thread(target=abort, name="nccl-abort", daemon=True)
    thread.start()
    thread.join(wait_s)
    if thread.is_alive():
        raise NCCLError(f"ncclCommAbort did not return within {wait_s:g} s (left running on a daemon thread)")
    if "error" in outcome:
        raise outcome["error"]


def cumem_enable(env) -> str:
    """NCCL_CUMEM_ENABLE as the trainer runs its NCCL groups (`env`'s, else "0": gspo_mcore/run/start.py
    sets 0, as SGLang runs). Every member of one communicator must agree ("invalid argument"
    otherwise), and vLLM 0.33 sets nothing: a server the trainer joins gets the same value."""
    return env.get("NCCL_CUMEM_ENABLE") or "0"


def version() -> tuple[int, int, int]:
    """The NCCL this trainer joins the servers with (major, minor, patch): the bound library's."""
    return decode_version(loaded().version())


def bound_path() -> str:
    """Which libnccl this process bound (for errors)."""
    return loaded().path


def library() -> str | None:
    """The libnccl this trainer's torch loads (the nvidia-nccl wheel), for the servers to load the
    same (VLLM_NCCL_SO_PATH: NCCL refuses to connect ranks of different versions); None if torch
    carries no such wheel."""
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except ModuleNotFoundError:  # no nvidia namespace package at all
        return None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / "lib" / "libnccl.so.2"
        if path.is_file():
            return str(path)
    return None


def require_for_vllm(found: tuple[int, int, int], path: str | None) -> None:
    """One line when the NCCL the servers are to load is older than vLLM's CUDA path takes."""
    if found < VLLM_NEEDS:
        need = ".".join(map(str, VLLM_NEEDS))
        raise NCCLError(f"NCCL {'.'.join(map(str, found))} ({path or nccl_library.SONAME}) is too old for vLLM's NCCL "
                        f"weight transfer, which needs {need} or newer (ncclCommSuspend / ncclCommResume): use a "
                        f"torch whose nvidia-nccl is >= {need} (torch 2.14's is 2.30.7), or set VLLM_NCCL_SO_PATH to "
                        "such a libnccl.so.2")


def check_for_vllm(path: str | None, loader=None) -> None:
    """The libnccl a vLLM server will load (`path`, its VLLM_NCCL_SO_PATH; else the soname) is new
    enough for it (require_for_vllm), read before any server starts."""
    kwargs = {"loader": loader} if loader is not None else {}
    library = nccl_library.load(env={"VLLM_NCCL_SO_PATH": path} if path else {}, wheel=None, **kwargs)
    require_for_vllm(decode_version(library.version()), library.path)


def decode_version(raw: int) -> tuple[int, int, int]:
    """ncclGetVersion's integer (NCCL >= 2.9: major * 10000 + minor * 100 + patch)."""
    return raw // 10000, raw // 100 % 100, raw % 100
