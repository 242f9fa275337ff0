"""Push over process groups trainer -> engine servers (NCCL on GPUs, gloo on CPU)."""

from __future__ import annotations

import math
import uuid

import torch
import torch.distributed as dist

from gspo_mcore.megatron.qwen3_moe.parallel_weights import owned_hf_plan, owned_hf_weights
from gspo_mcore.megatron.parallel import device
from gspo_mcore.weight_sync.buckets import bucketed, owned_rounds, settle, update_session


class DistributedWeightSync:
    """Push the trainer's weights into running servers over process groups.

    Each trainer rank that owns tensors is rank 0 of one group per server (that server's TP
    workers are ranks 1..tp; the engine opens it: `ProcessGroupPush.open_weight_group`). Per
    bucket, the owner packs it in the engine's layout and sends it to every server
    (`ProcessGroupPush.send_bucket`). An engine whose servers take weights from one sender only
    (`ProcessGroupPush.single_sender`: vLLM) gets every bucket from rank 0, which receives the
    other owners' buckets first (relayed).
    Construction and `push` are collective over all trainer ranks.
    """

    def __init__(self, model, arch, spec: str, engine, *, backend: str,
                 master_address: str, bucket_bytes: int, dtype: torch.dtype, group_timeout_s: float = 600.0):
        self.model, self.arch, self.spec, self.engine = model, arch, spec, engine
        self.bucket_bytes, self.dtype = bucket_bytes, dtype
        self.relayed = engine.single_sender
        self.sender = dist.get_rank() == 0 if self.relayed else bool(owned_hf_plan(model, arch, spec))
        self.groups: list[tuple[str, str, object]] = []  # (url, name, group) per server, on sender ranks
        if self.sender:
            rank, run = dist.get_rank(), uuid.uuid4().hex[:12]
            for index, url in enumerate(engine.urls):
                # Unique per run: a long-lived server keeps the groups of earlier runs
                # until they are destroyed, and joining a taken name hangs.
                name = f"gspo-sync-{run}-r{rank}-s{index}"
                self.groups.append((url, name, engine.open_weight_group(url, name, master_address, backend,
                                                                        group_timeout_s)))
        dist.barrier()

    def close(self) -> None:
        """Leave the groups on both sides (best effort: also called when the run fails)."""
        for url, name, group in self.groups:
            self.engine.close_weight_group(url, name, group)
        self.groups = []

    def _send(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        bucket = [(name, t.to(self.dtype)) for name, t in bucket]
        flat = self.engine.pack_bucket(bucket)
        # Before any post: the TP all_gathers that built this bucket must have run. Else (GPUs,
        # TP > 1) this owner's broadcast could queue behind a gather that rank 0 has not
        # enqueued, while rank 0 waits for the server this owner just posted to: a cycle
        # (SGLang's update_weights_from_distributed answers before its broadcast completes).
        settle(flat)
        self.engine.send_bucket(self.groups, bucket, flat)

    def _relay(self, src: int, layout: list[tuple[str, tuple[int, ...]]], bucket: list) -> int:
        """Rank `src`'s bucket (names and shapes `layout`; the tensors `bucket` on `src`) to rank 0
        (point to point), which sends it to every server. Returns the bytes this rank sent."""
        rank = dist.get_rank()
        if rank not in (0, src):
            return 0
        size = sum(math.prod(shape) for _, shape in layout) * self.dtype.itemsize
        if rank == src:
            flat = self.engine.pack_bucket(bucket)
            settle(flat)  # the TP gathers that built it (see _send), before rank 0 can wait on it
            if src != 0:
                dist.send(flat, dst=0)
                return size
        else:
            flat = torch.empty(size, dtype=torch.uint8, device=device())
            dist.recv(flat, src=src)
            settle(flat)  # landed before the servers are told to read it
        # The engine reads names, dtypes and shapes off the bucket; the bytes travel in `flat`.
        described = [(name, torch.empty(shape, dtype=self.dtype, device="meta")) for name, shape in layout]
        self.engine.send_bucket(self.groups, described, flat)
        return size

    def push(self, weight_version: str) -> int:
        """Send every weight; afterwards the servers generate with them, tagged `weight_version`.
        Returns the bytes this rank sent (per server; relayed: to rank 0, or rank 0's to the servers)."""
        sent = 0
        with update_session(self.engine, weight_version):
            if self.relayed:
                for layouts, bucket in owned_rounds(self.model, self.arch, self.spec, self.bucket_bytes, self.dtype):
                    sent += sum(self._relay(src, layout, bucket) for src, layout in enumerate(layouts) if layout)
                return sent
            # Every rank iterates: the export gathers TP shards collectively.
            for bucket in bucketed(owned_hf_weights(self.model, self.arch, self.spec), self.bucket_bytes, self.dtype):
                self._send(bucket)
                sent += sum(t.numel() for _, t in bucket) * self.dtype.itemsize
        return sent
