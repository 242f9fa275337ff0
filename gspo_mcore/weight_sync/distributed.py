"""Push over process groups trainer -> engine servers (NCCL on GPUs, gloo on CPU)."""

from __future__ import annotations

import uuid

import torch
import torch.distributed as dist

from gspo_mcore.models.qwen3_moe.parallel_weights import owned_hf_plan, owned_hf_weights
from gspo_mcore.weight_sync.buckets import bucketed, settle, update_session


class DistributedWeightSync:
    """Push the trainer's weights into running servers over process groups.

    Each trainer rank that owns tensors is rank 0 of one group per server (that server's TP
    workers are ranks 1..tp; the engine opens it: `Engine.open_weight_group`). Per bucket, the
    owner packs it in the engine's layout and sends it to every server (`Engine.send_bucket`).
    Construction and `push` are collective over all trainer ranks.
    """

    def __init__(self, model, arch, spec: str, engine, *, backend: str,
                 master_address: str, bucket_bytes: int, dtype: torch.dtype, group_timeout_s: float = 600.0):
        self.model, self.arch, self.spec, self.engine = model, arch, spec, engine
        self.bucket_bytes, self.dtype = bucket_bytes, dtype
        self.owner = bool(owned_hf_plan(model, arch, spec))
        self.groups: list[tuple[str, str, object]] = []  # (url, name, group) per server, on owner ranks
        if self.owner:
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

    def push(self, weight_version: str) -> int:
        """Send every weight; afterwards the servers generate with them, tagged `weight_version`.
        Returns the bytes this rank sent (per server)."""
        sent = 0
        with update_session(self.engine, weight_version):
            # Every rank iterates: the export gathers TP shards collectively.
            for bucket in bucketed(owned_hf_weights(self.model, self.arch, self.spec), self.bucket_bytes, self.dtype):
                self._send(bucket)
                sent += sum(t.numel() for _, t in bucket) * self.dtype.itemsize
        return sent
