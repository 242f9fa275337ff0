"""Push into colocated servers through memory they can map (CUDA IPC; shared memory on CPU)."""

from __future__ import annotations

import math
import os
import socket
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from gspo_mcore.common.errors import WeightSyncError
from gspo_mcore.common.netaddr import local_addresses
from gspo_mcore.megatron.parallel import device, host_group
from gspo_mcore.weight_sync.buckets import owned_rounds, settle, update_session


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
    host (`SharedMemoryPush.shared_payload` / `load_shared`; CUDA IPC on GPUs, shared
    memory files on CPU). NCCL cannot do this: a communicator refuses two ranks on one GPU.
    Every trainer rank needs every bucket, so each is first broadcast from its owner, round by
    round (`owned_rounds`).
    Construction and `push` are collective over all trainer ranks."""

    def __init__(self, model, arch, spec: str, engine, *, bucket_bytes: int, dtype: torch.dtype):
        engine.prepare_sharing(on_gpu=device().type == "cuda")
        self.model, self.arch, self.spec, self.engine = model, arch, spec, engine
        self.bucket_bytes, self.dtype = bucket_bytes, dtype
        readers = colocated_readers(engine.urls, [engine.tp_size(url) for url in engine.urls], where_ranks_run())
        # (url, the trainer ranks its TP ranks read from) for the servers this rank posts to.
        self.posts = [(url, ranks) for url, ranks in zip(engine.urls, readers) if ranks[0] == dist.get_rank()]

    def _load_everywhere(self, flat: torch.Tensor, layout: list[tuple[str, tuple[int, ...]]]) -> None:
        payloads = [None] * dist.get_world_size()
        dist.all_gather_object(payloads, self.engine.shared_payload(flat, layout, self.dtype))
        for url, ranks in self.posts:
            self.engine.load_shared(url, [payloads[r] for r in ranks])
        # Every server has loaded it: the buffers may go. On the host group: the servers load on
        # these GPUs meanwhile, where an NCCL barrier's kernel would spin.
        dist.barrier(group=host_group())

    def _share(self, src: int, layout: list[tuple[str, tuple[int, ...]]], bucket: list) -> int:
        """Rank `src`'s bucket (names and shapes `layout`; the tensors `bucket` on `src`) on every
        rank, then loaded by every server. Returns the bytes this rank contributed."""
        size = sum(math.prod(shape) for _, shape in layout) * self.dtype.itemsize
        mine = dist.get_rank() == src
        flat = self.engine.pack_bucket(bucket) if mine else torch.empty(size, dtype=torch.uint8, device=device())
        dist.broadcast(flat, src=src)
        settle(flat)  # the servers read this memory directly (CUDA IPC): the broadcast must have landed
        self._load_everywhere(flat, layout)
        return size if mine else 0

    def push(self, weight_version: str) -> int:
        """Send every weight; afterwards the servers generate with them, tagged `weight_version`.
        Returns the bytes this rank owned."""
        sent = 0
        with update_session(self.engine, weight_version):
            for layouts, bucket in owned_rounds(self.model, self.arch, self.spec, self.bucket_bytes, self.dtype):
                sent += sum(self._share(src, layout, bucket) for src, layout in enumerate(layouts) if layout)
        return sent

    def close(self) -> None:
        pass  # nothing held between pushes
