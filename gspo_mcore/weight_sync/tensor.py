"""Push into colocated servers through memory they can map (CUDA IPC; shared memory on CPU)."""

from __future__ import annotations

import math
import os
import socket
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from gspo_mcore.errors import WeightSyncError
from gspo_mcore.models.qwen3_moe.parallel_weights import export_hf_weights, owns
from gspo_mcore.netaddr import local_addresses
from gspo_mcore.parallel import device
from gspo_mcore.rollout.engine_control import EngineControl
from gspo_mcore.weight_sync.buckets import bucketed, flatten, settle, update_session


def _host_addresses(host: str) -> set[str]:
    try:
        return {host, socket.gethostbyname(host)}
    except OSError:
        return {host}


def where_ranks_run() -> list[tuple[set[str], int]]:
    """(names and addresses of its host, LOCAL_RANK) of every trainer rank. Collective."""
    # Interface addresses, not the name lookup of our own hostname (127.0.1.1 on Debian).
    mine = (local_addresses(), int(os.environ.get("LOCAL_RANK", 0)))
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    return ranks


def colocated_readers(urls: list[str], tps: list[int], ranks: list[tuple[set[str], int]]) -> list[list[int]]:
    """For each server, the trainer ranks whose GPUs its TP ranks run on: the i-th server of a
    host (URL order) on that host's GPUs i * tp .. i * tp + tp - 1, matched to the trainer
    ranks (`where_ranks_run`, in any rank order) with those LOCAL_RANKs on that host."""
    hosts = {frozenset(addresses) for addresses, _ in ranks}
    readers, next_gpu = [], {}
    for url, tp in zip(urls, tps):
        host = urlparse(url).hostname or ""
        addresses = _host_addresses(host)
        loopback = any(a.startswith("127.") for a in addresses) or host == "localhost"
        if loopback and len(hosts) > 1:
            raise WeightSyncError(f"weight_sync.method 'tensor': server {url} is on the loopback address but the "
                                  f"trainer spans {len(hosts)} hosts: name each server by its host")
        on_host = [r for r, (names, _) in enumerate(ranks) if loopback or names & addresses]
        first = next_gpu.get(host, 0)
        next_gpu[host] = first + tp
        by_gpu = {ranks[r][1]: r for r in on_host}
        missing = [gpu for gpu in range(first, first + tp) if gpu not in by_gpu]
        if missing:
            raise WeightSyncError(f"weight_sync.method 'tensor': server {url} (TP {tp}) runs on GPUs "
                                  f"{first}..{first + tp - 1} of its host, but no trainer rank has LOCAL_RANK {missing[0]} "
                                  "there (colocated: every server GPU must be a trainer GPU)")
        readers.append([by_gpu[gpu] for gpu in range(first, first + tp)])
    if sorted(r for rs in readers for r in rs) != list(range(len(ranks))):
        raise WeightSyncError(f"weight_sync.method 'tensor': the servers' {sum(tps)} TP ranks do not cover the "
                              f"{len(ranks)} trainer ranks one to one")
    return readers


class TensorWeightSync:
    """Push into colocated servers through memory they can map: the i-th server (URL order) of
    a host runs its TP rank k on that host's GPU i * tp + k (as the colocated launch places
    them) and reads each bucket from the copy of the trainer rank with that LOCAL_RANK on that
    host (`/update_weights_from_tensor`, SGLang's flattened bucket; CUDA IPC on GPUs, shared
    memory files on CPU). NCCL cannot do this: a communicator refuses two ranks on one GPU.
    Every trainer rank needs every bucket, so each is first broadcast from its owner. Each round every rank takes one bucket of its
    full export stream (`export_hf_weights`) and keeps what it owns: the ranks of a TP group
    hold tensors of the same shapes in the same order, so their buckets end at the same
    tensor and the TP gathers inside stay in step (expert-TP 1: experts need no gather).
    Construction and `push` are collective over all trainer ranks."""

    def __init__(self, model, arch, spec: str, control: EngineControl, *, bucket_bytes: int, dtype: torch.dtype):
        if device().type == "cuda":
            from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

            # CUDA IPC handles name the device by UUID: the servers number their GPUs differently.
            monkey_patch_torch_reductions()
        else:
            # Rebuildable by path in any process (the default passes file descriptors only
            # to processes of the same multiprocessing family).
            torch.multiprocessing.set_sharing_strategy("file_system")
        self.model, self.arch, self.spec, self.control = model, arch, spec, control
        self.bucket_bytes, self.dtype = bucket_bytes, dtype
        readers = colocated_readers(control.urls, [control.tp_size(url) for url in control.urls], where_ranks_run())
        # (url, the trainer ranks its TP ranks read from) for the servers this rank posts to.
        self.posts = [(url, ranks) for url, ranks in zip(control.urls, readers) if ranks[0] == dist.get_rank()]

    def _load_everywhere(self, flat: torch.Tensor, metadata: list) -> None:
        from sglang.srt.utils import MultiprocessingSerializer  # heavy (SGLang): this method only

        payload = MultiprocessingSerializer.serialize({"flattened_tensor": flat, "metadata": metadata}, output_str=True)
        payloads = [None] * dist.get_world_size()
        dist.all_gather_object(payloads, payload)
        for url, ranks in self.posts:
            self.control.call(url, "/update_weights_from_tensor", {
                "serialized_named_tensors": [payloads[r] for r in ranks], "load_format": "flattened_bucket",
                "flush_cache": False})
        dist.barrier()  # every server has loaded it: the buffers may go

    def _share(self, src: int, layout: list[tuple[str, tuple[int, ...]]], bucket: list) -> int:
        """Rank `src`'s bucket (names and shapes `layout`; the tensors `bucket` on `src`) on every
        rank, then loaded by every server. Returns the bytes this rank contributed."""
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata  # heavy (SGLang)


        metadata, start = [], 0
        for name, shape in layout:
            size = math.prod(shape) * self.dtype.itemsize
            metadata.append(FlattenedTensorMetadata(name=name, shape=torch.Size(shape), dtype=self.dtype,
                                                    start_idx=start, end_idx=start + size, numel=size))
            start += size
        mine = dist.get_rank() == src
        flat = flatten(bucket) if mine else torch.empty(start, dtype=torch.uint8, device=device())
        dist.broadcast(flat, src=src)
        settle(flat)  # the servers read this memory directly (CUDA IPC): the broadcast must have landed
        self._load_everywhere(flat, metadata)
        return start if mine else 0

    def push(self, weight_version: str) -> int:
        """Send every weight; afterwards the servers generate with them, tagged `weight_version`.
        Returns the bytes this rank owned."""
        sent, exhausted = 0, False
        with update_session(self.control, weight_version):
            stream = bucketed(export_hf_weights(self.model, self.arch, self.spec), self.bucket_bytes, self.dtype)
            while True:
                taken = next(stream, None)
                exhausted |= taken is None
                bucket = [(name, t.to(self.dtype)) for name, t in taken or [] if owns(name)]
                rounds = [None] * dist.get_world_size()
                dist.all_gather_object(rounds, (exhausted, [(name, tuple(t.shape)) for name, t in bucket]))
                if all(done for done, _ in rounds):
                    break
                sent += sum(self._share(src, layout, bucket) for src, (_, layout) in enumerate(rounds) if layout)
        return sent

    def close(self) -> None:
        pass  # nothing held between pushes
