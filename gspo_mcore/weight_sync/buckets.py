"""Weights in transit: bounded buckets, the engine's update session around a push."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Iterator

import torch
import torch.distributed as dist

from gspo_mcore.megatron.qwen3_moe.parallel_weights import export_hf_weights, owns
from gspo_mcore.megatron.parallel import host_group


def bucketed(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
             dtype: torch.dtype | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group (name, tensor) pairs, in order, into lists of at most `bucket_bytes` (counted in
    `dtype` if given: what will be sent; a tensor larger than that travels alone). Streams:
    one bucket is held at a time."""
    bucket, size = [], 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * (dtype.itemsize if dtype is not None else tensor.element_size())
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


@contextmanager
def update_session(engine, weight_version: str):
    """The engine's weight-update session (`UpdateSession`) around a push by all trainer ranks
    (collective): rank 0 opens it once every rank is ready and closes it, tagging
    `weight_version`, once every rank has sent. The ranks wait for rank 0's HTTP calls on the host group: an NCCL barrier would spin
    a kernel on every GPU meanwhile, on the GPUs a colocated engine is loading on."""
    if dist.get_rank() == 0:
        engine.begin_update()
    dist.barrier(group=host_group())
    yield
    dist.barrier(group=host_group())
    if dist.get_rank() == 0:
        engine.end_update(weight_version)
    dist.barrier(group=host_group())


def settle(tensor: torch.Tensor) -> None:
    """Block the host until every kernel queued so far on `tensor`'s device stream has run (the
    gathers that built a bucket, a broadcast into it). NCCL calls and copies return before their
    data moves (gloo blocks, so CPU runs never need this): a bucket must be complete before a
    server is told to read it."""
    if tensor.is_cuda:
        torch.cuda.current_stream(tensor.device).synchronize()


def owned_rounds(model, arch, spec: str, bucket_bytes: int,
                 dtype: torch.dtype) -> Iterator[tuple[list[list[tuple[str, tuple[int, ...]]]], list]]:
    """The push in rounds, when one rank's bucket must reach others: each round every rank takes
    one bucket of its full export stream (`export_hf_weights`) and keeps what it owns; yields
    every rank's layout ((name, shape) each, ranks in order; empty: nothing this round) and this
    rank's bucket (in `dtype`). The ranks of a TP group hold tensors of the same shapes in the
    same order, so their buckets end at the same tensor and the TP gathers inside stay in step
    (expert-TP 1: experts need no gather). Collective over all trainer ranks."""
    stream = bucketed(export_hf_weights(model, arch, spec), bucket_bytes, dtype)
    exhausted = False
    while True:
        taken = next(stream, None)
        exhausted |= taken is None
        bucket = [(name, t.to(dtype)) for name, t in taken or [] if owns(name)]
        rounds = [None] * dist.get_world_size()
        dist.all_gather_object(rounds, (exhausted, [(name, tuple(t.shape)) for name, t in bucket]))
        if all(done for done, _ in rounds):
            return
        yield [layout for _, layout in rounds], bucket
