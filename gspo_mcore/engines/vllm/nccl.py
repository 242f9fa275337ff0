"""The trainer's end of vLLM's NCCL weight transfer (the "nccl" backend of
vllm/distributed/weight_transfer/, its unique-id rendezvous: nccl_common.decode_nccl_unique_id,
pynccl.PyNcclCommunicator.from_unique_id_bytes) without vLLM in the trainer's Python: a raw NCCL
communicator from a unique id we make (torch.cuda.nccl: torch/csrc/cuda/python_nccl.cpp). vLLM's
workers are ranks 1..tp, we are rank 0, the broadcast's root. CUDA only; the engine calls these
through this module so a test can stand in for them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch


def unique_id() -> bytes:
    """ncclGetUniqueId: 128 bytes naming our bootstrap address (NCCL_SOCKET_IFNAME applies)."""
    return torch.cuda.nccl.unique_id()


def communicator(world_size: int, uid: bytes):
    """ncclCommInitRank as rank 0 (blocks, without the GIL, until every worker joined), then the
    one-element float32 all-reduce every vLLM worker issues right after its own init (a peer
    that skips it deadlocks them all)."""
    comm = torch.cuda.nccl.init_rank(world_size, uid, 0)
    warm_up = torch.zeros(1, dtype=torch.float32, device=torch.device("cuda", torch.cuda.current_device()))
    torch.cuda.nccl.all_reduce([warm_up], comms=[comm])
    torch.cuda.current_stream().synchronize()
    return comm


def broadcast(comm, flat: torch.Tensor) -> None:
    """ncclBroadcast of `flat` from us (root 0) on the current stream; returns before it moves."""
    torch.cuda.nccl.broadcast([flat], root=0, comms=[comm])


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
