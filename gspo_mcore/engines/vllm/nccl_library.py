"""The NCCL calls of the trainer's end of vLLM's NCCL weight transfer, bound with ctypes on a
libnccl.so.2, as vLLM binds its own (vllm/distributed/device_communicators/pynccl_wrapper.py
NCCLLibrary). Not torch's binding: `torch.cuda.nccl.init_rank` parses "is#i" without
PY_SSIZE_T_CLEAN, and CPython 3.10-3.12 raise SystemError for it (pytorch/pytorch#38019, open),
so no communicator could ever be made through it.

Declarations from NCCL's src/nccl.h.in. No torch here: buffers and streams are addresses (the
caller's `tensor.data_ptr()`, `stream.cuda_stream`), so every call can be held on CPU by a
stand-in for the library. Every ncclResult_t other than ncclSuccess becomes one line naming the
call and NCCL's own words for it (ncclGetErrorString, and ncclGetLastError where it says more)."""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Callable

from gspo_mcore.common.errors import WeightSyncError

SONAME = "libnccl.so.2"

Result = ctypes.c_int  # ncclResult_t (a C enum: int)
Comm = ctypes.c_void_p  # ncclComm_t (a pointer to an opaque struct)
Stream = ctypes.c_void_p  # cudaStream_t
Buffer = ctypes.c_void_p  # device memory
DataType = ctypes.c_int  # ncclDataType_t
RedOp = ctypes.c_int  # ncclRedOp_t
UNIQUE_ID_BYTES = 128  # NCCL_UNIQUE_ID_BYTES


class UniqueId(ctypes.Structure):
    """ncclUniqueId: `char internal[NCCL_UNIQUE_ID_BYTES]`, passed to ncclCommInitRank by value."""
    _fields_ = [("internal", ctypes.c_byte * UNIQUE_ID_BYTES)]


SUCCESS = 0  # ncclSuccess
SUM = 0  # ncclSum
# ncclDataType_t by torch's dtype names (ncclInt8 .. ncclBfloat16; stable since NCCL 2.10).
DATA_TYPES = {"int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5, "float16": 6,
              "float32": 7, "float64": 8, "bfloat16": 9}

# (name, restype, argtypes) as nccl.h declares them.
FUNCTIONS = [
    ("ncclGetErrorString", ctypes.c_char_p, [Result]),
    ("ncclGetVersion", Result, [ctypes.POINTER(ctypes.c_int)]),
    ("ncclGetUniqueId", Result, [ctypes.POINTER(UniqueId)]),
    ("ncclCommInitRank", Result, [ctypes.POINTER(Comm), ctypes.c_int, UniqueId, ctypes.c_int]),
    ("ncclAllReduce", Result, [Buffer, Buffer, ctypes.c_size_t, DataType, RedOp, Comm, Stream]),
    ("ncclBroadcast", Result, [Buffer, Buffer, ctypes.c_size_t, DataType, ctypes.c_int, Comm, Stream]),
    ("ncclCommAbort", Result, [Comm]),
    ("ncclCommGetAsyncError", Result, [Comm, ctypes.POINTER(Result)]),
    ("ncclGetLastError", ctypes.c_char_p, [Comm]),
]
IN_PROGRESS = 7  # ncclInProgress: a non-blocking communicator's call not done yet (not an error)
OPTIONAL = {"ncclGetLastError"}  # NCCL >= 2.13: what went wrong, in more words


class NCCLError(WeightSyncError):
    """An NCCL call that failed, or no NCCL to call: one line."""


def one_line(text: str) -> str:
    return " ".join(str(text).split())


@dataclass
class Library:
    """The bound functions of one loaded libnccl (`cdll`: a ctypes.CDLL, or a stand-in with the
    same attributes); `path` says which, in errors."""
    cdll: object
    path: str

    def __post_init__(self):
        for name, restype, argtypes in FUNCTIONS:
            function = getattr(self.cdll, name, None)
            if function is None and name in OPTIONAL:
                continue
            if function is None:
                raise NCCLError(f"{self.path}: no {name} (an NCCL too old for vLLM's weight transfer)")
            function.restype, function.argtypes = restype, argtypes

    def check(self, call: str, result: int, comm: int | None = None) -> None:
        """A non-zero ncclResult_t as one line: the call, NCCL's string, its code, the library."""
        if result == SUCCESS:
            return
        reason = self.reason(result)
        last = getattr(self.cdll, "ncclGetLastError", None)
        detail = last(comm) if last is not None else None
        detail = detail.decode(errors="replace") if isinstance(detail, bytes) else ""
        detail = f": {detail}" if detail.strip() and detail.strip() not in reason else ""
        raise NCCLError(one_line(f"{call} failed: {reason} (ncclResult_t {result}, {self.path}){detail}"))

    def version(self) -> int:
        """ncclGetVersion: major * 10000 + minor * 100 + patch (NCCL >= 2.9)."""
        value = ctypes.c_int()
        self.check("ncclGetVersion", self.cdll.ncclGetVersion(ctypes.byref(value)))
        return value.value

    def unique_id(self) -> bytes:
        """ncclGetUniqueId: 128 bytes naming this process's bootstrap address."""
        uid = UniqueId()
        self.check("ncclGetUniqueId", self.cdll.ncclGetUniqueId(ctypes.byref(uid)))
        return id_bytes(uid)

    def comm_init_rank(self, world_size: int, uid: bytes, rank: int) -> int:
        """ncclCommInitRank on the calling thread's CUDA device; blocks (ctypes lets the GIL go)
        until every rank of `world_size` joined. Returns the communicator's handle."""
        comm = Comm()
        self.check("ncclCommInitRank", self.cdll.ncclCommInitRank(ctypes.byref(comm), world_size,
                                                                  id_struct(uid), rank))
        if not comm.value:
            raise NCCLError(f"ncclCommInitRank returned no communicator ({self.path})")
        return comm.value

    def all_reduce(self, buffer: int, count: int, dtype: str, comm: int, stream: int) -> None:
        """ncclAllReduce (sum) of `count` elements in place, queued on `stream`."""
        self.check("ncclAllReduce", self.cdll.ncclAllReduce(buffer, buffer, count, data_type(dtype), SUM, comm,
                                                            stream), comm)

    def broadcast(self, buffer: int, count: int, dtype: str, root: int, comm: int, stream: int) -> None:
        """ncclBroadcast of `count` elements in place from `root`, queued on `stream`."""
        self.check("ncclBroadcast", self.cdll.ncclBroadcast(buffer, buffer, count, data_type(dtype), root, comm,
                                                            stream), comm)

    def async_error(self, comm: int) -> int:
        """ncclCommGetAsyncError: the communicator's asynchronous state (SUCCESS, IN_PROGRESS, or the
        error a kernel or NCCL's proxy thread met: a peer gone, a network error)."""
        state = Result()
        self.check("ncclCommGetAsyncError", self.cdll.ncclCommGetAsyncError(comm, ctypes.byref(state)), comm)
        return state.value

    def reason(self, result: int) -> str:
        """NCCL's own words for a result code."""
        text = self.cdll.ncclGetErrorString(result)
        return text.decode(errors="replace") if isinstance(text, bytes) else str(text)

    def comm_abort(self, comm: int) -> None:
        """ncclCommAbort: frees the communicator's resources without waiting for its peers (a
        server that left, or never joined), ending what it has in flight."""
        self.check("ncclCommAbort", self.cdll.ncclCommAbort(comm))


def id_struct(uid: bytes) -> UniqueId:
    if not isinstance(uid, (bytes, bytearray)) or len(uid) != UNIQUE_ID_BYTES:
        raise NCCLError(f"an NCCL unique id is {UNIQUE_ID_BYTES} bytes, got "
                        f"{len(uid) if isinstance(uid, (bytes, bytearray)) else type(uid).__name__}")
    struct = UniqueId()
    ctypes.memmove(ctypes.addressof(struct), bytes(uid), UNIQUE_ID_BYTES)
    return struct


def id_bytes(uid: UniqueId) -> bytes:
    """The struct's 128 bytes as they are (not `.internal`: c_char arrays stop at a zero byte)."""
    return ctypes.string_at(ctypes.addressof(uid), UNIQUE_ID_BYTES)


def data_type(name: str) -> int:
    if name not in DATA_TYPES:
        raise NCCLError(f"NCCL has no data type for {name} (it moves {', '.join(DATA_TYPES)})")
    return DATA_TYPES[name]


def candidates(env, wheel: str | None) -> list[tuple[str, bool]]:
    """Where to look, in order, and whether a failure there ends the search:
    - VLLM_NCCL_SO_PATH when set: the servers load that one too (gspo_mcore/engines/vllm/server.py
      server_env keeps it), and NCCL connects equal versions only: no other;
    - the soname, as vLLM's find_nccl_library does (vllm/utils/nccl.py): the dynamic loader
      answers with the copy torch already loaded (its libtorch_cuda needs libnccl.so.2), else
      its search path;
    - the nvidia-nccl wheel's file (`wheel`), for a process whose torch loaded none."""
    if env.get("VLLM_NCCL_SO_PATH"):
        return [(env["VLLM_NCCL_SO_PATH"], True)]
    return [(SONAME, False)] + ([(wheel, False)] if wheel else [])


def load(env=None, wheel: str | None = None, loader: Callable[[str], object] = ctypes.CDLL) -> Library:
    """The first libnccl that loads, bound; else one line saying what was tried."""
    env = os.environ if env is None else env
    tried = []
    for path, only in candidates(env, wheel):
        try:
            return Library(loader(path), path)
        except OSError as err:
            tried.append(f"{path} ({one_line(err)})")
            if only:
                raise NCCLError(f"VLLM_NCCL_SO_PATH={path}: cannot load it ({one_line(err)})") from None
    raise NCCLError("no libnccl.so.2 to bind for the weight transfer: tried " + "; ".join(tried) +
                    " (install the nvidia-nccl wheel of the trainer's torch, or set VLLM_NCCL_SO_PATH)")
