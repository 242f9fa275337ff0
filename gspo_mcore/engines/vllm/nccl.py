"""The trainer's end of vLLM's NCCL weight transfer (the "nccl" backend of
vllm/distributed/weight_transfer/, its unique-id rendezvous: nccl_common.decode_nccl_unique_id,
pynccl.PyNcclCommunicator.from_unique_id_bytes) without vLLM in the trainer's Python: a raw NCCL
communicator from a unique id we make (torch.cuda.nccl: torch/csrc/cuda/python_nccl.cpp). vLLM's
workers are ranks 1..tp, we are rank 0, the broadcast's root. CUDA only; the engine calls these
through this module so a test can stand in for them."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch


def unique_id() -> bytes:
    """ncclGetUniqueId: 128 bytes naming our bootstrap address (NCCL_SOCKET_IFNAME applies)."""
    return torch.cuda.nccl.unique_id()


def current_device() -> int:
    """The CUDA device of the calling thread (the rank's: torch.cuda.set_device at start)."""
    return torch.cuda.current_device()


@dataclass
class WeightGroup:
    """Our end of one server's communicator: the raw NCCL communicator and the stream its
    broadcasts run on, apart from the trainer's: a broadcast the server never receives (it
    refused the bucket) then waits there, not in front of the trainer's later work. Never
    destroyed: torch's comm_destroy is a no-op (torch/csrc/cuda/nccl.cpp), so a communicator a
    server abandoned cannot block the process's exit in ncclCommDestroy."""
    comm: object
    stream: object  # torch.cuda.Stream


def communicator(world_size: int, uid: bytes, device: int) -> WeightGroup:
    """ncclCommInitRank as rank 0 on `device` (blocks, without the GIL, until every worker
    joined), then the one-element float32 all-reduce every vLLM worker issues right after its own
    init (a peer that skips it deadlocks them all). Called on a thread of its own: a new thread
    starts on CUDA device 0, and NCCL binds the communicator to the calling thread's device."""
    torch.cuda.set_device(device)
    comm = torch.cuda.nccl.init_rank(world_size, uid, 0)
    stream = torch.cuda.Stream(device=device)
    warm_up = torch.zeros(1, dtype=torch.float32, device=torch.device("cuda", device))
    stream.wait_stream(torch.cuda.current_stream(device))  # the zeros are written
    torch.cuda.nccl.all_reduce([warm_up], streams=[stream], comms=[comm])
    stream.synchronize()
    return WeightGroup(comm, stream)


def broadcast(group: WeightGroup, flat: torch.Tensor) -> None:
    """ncclBroadcast of `flat` from us (root 0) on the group's stream, after the work queued so far
    on the current stream (what wrote `flat`); returns before it moves. `flat`'s memory is not
    reused until the broadcast ran (record_stream)."""
    group.stream.wait_stream(torch.cuda.current_stream(flat.device))
    flat.record_stream(group.stream)
    torch.cuda.nccl.broadcast([flat], root=0, streams=[group.stream], comms=[group.comm])


def cumem_enable(env) -> str:
    """NCCL_CUMEM_ENABLE as the trainer runs its NCCL groups (`env`'s, else "0": gspo_mcore/run/start.py
    sets 0, as SGLang runs). Every member of one communicator must agree ("invalid argument"
    otherwise), and vLLM 0.33 sets nothing: a server the trainer joins gets the same value."""
    return env.get("NCCL_CUMEM_ENABLE") or "0"


def version() -> tuple[int, int, int]:
    """The NCCL this trainer's torch runs (major, minor, patch)."""
    return tuple(torch.cuda.nccl.version()[:3])


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


def decode_version(raw: int) -> tuple[int, int, int]:
    """ncclGetVersion's integer (NCCL >= 2.9: major * 10000 + minor * 100 + patch)."""
    return raw // 10000, raw // 100 % 100, raw % 100
