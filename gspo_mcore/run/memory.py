"""The trainer's memory between phases and its peak per step (CUDA memory on GPUs, resident memory on CPU)."""

from __future__ import annotations

import psutil
import torch
import torch.distributed as dist

from gspo_mcore.megatron.parallel import host_group


def release_cached_memory() -> None:
    """Give the CUDA caching allocator's free blocks back (a colocated engine and the next phase
    need them); nothing on CPU."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak_memory_gb() -> float:
    """This step's peak over the trainer ranks: CUDA memory allocated (reset each step), or the
    process's resident memory on CPU. Collective (host group)."""
    if torch.cuda.is_available():
        mine = torch.cuda.max_memory_allocated() / 2**30
    else:
        mine = psutil.Process().memory_info().rss / 2**30
    peak = torch.tensor([mine], dtype=torch.float64)  # host: reduced over the gloo host group
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=host_group())
    return peak.item()
