"""Push over process groups trainer -> SGLang servers (NCCL on GPUs, gloo on CPU)."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from gspo_mcore.errors import WeightSyncError
from gspo_mcore.models.qwen3_moe.parallel_weights import owned_hf_plan, owned_hf_weights
from gspo_mcore.netaddr import address_towards, listening_store
from gspo_mcore.rollout.engine_control import EngineControl
from gspo_mcore.weight_sync.buckets import bucketed, flatten, settle, update_session


class DistributedWeightSync:
    """Push the trainer's weights into running SGLang servers over process groups.

    Each trainer rank that owns tensors is rank 0 of one group per server (that server's TP
    workers are ranks 1..tp). Per bucket and server, in a fixed server order, the owner posts
    `/update_weights_from_distributed` and at once broadcasts the bucket: a server then only
    ever waits for a sender already broadcasting to it, so owners pushing concurrently (and
    ranks busy in TP gathers) cannot deadlock, whatever order the servers see requests in.
    Construction and `push` are collective over all trainer ranks.
    """

    def __init__(self, model, arch, spec: str, control: EngineControl, *, backend: str,
                 master_address: str, bucket_bytes: int, dtype: torch.dtype, group_timeout_s: float = 600.0):

        self.model, self.arch, self.spec, self.control = model, arch, spec, control
        self.bucket_bytes, self.dtype = bucket_bytes, dtype
        self.owner = bool(owned_hf_plan(model, arch, spec))
        self._stores: list = []
        self.groups: list[tuple[str, object]] = []  # (name, group) per server, on owner ranks
        if self.owner:
            rank, run = dist.get_rank(), uuid.uuid4().hex[:12]
            for index, url in enumerate(control.urls):
                # Unique per run: a long-lived server keeps the groups of earlier runs
                # until they are destroyed, and joining a taken name hangs.
                name = f"gspo-sync-{run}-r{rank}-s{index}"
                self.groups.append((name, self._join(url, name, backend, master_address, group_timeout_s)))
        dist.barrier()

    def _join(self, url: str, name: str, backend: str, master_address: str, timeout_s: float):
        from sglang.srt.utils import init_custom_process_group  # heavy (SGLang): this method only



        world_size = 1 + self.control.tp_size(url)
        if master_address == "auto":  # multi-node: the address this rank reaches the server from
            master_address = address_towards(urlparse(url).hostname)
        # Our own store, not a tcp:// init_method: under torchrun that would connect to the
        # elastic agent's store instead of hosting one (TORCHELASTIC_USE_AGENT_STORE). It
        # listens on that one address, not on every interface.
        store = listening_store(master_address, world_size, timedelta(seconds=timeout_s))
        body = {"master_address": master_address, "master_port": store.port, "rank_offset": 1,
                "world_size": world_size, "group_name": name, "backend": backend}
        with ThreadPoolExecutor(max_workers=1) as pool:
            answer = pool.submit(self.control.call, url, "/init_weights_update_group", body)
            # The servers wrap the store in a PrefixStore named after the group; so do we.
            group = init_custom_process_group(backend=backend, store=dist.PrefixStore(name, store),
                                              world_size=world_size, rank=0, group_name=name,
                                              timeout=timedelta(seconds=timeout_s))
            answer.result()
        self._stores.append(store)  # the group needs its store alive
        return group

    def close(self) -> None:
        """Leave the groups on both sides (best effort: also called when the run fails)."""
        for url, (name, group) in zip(self.control.urls, self.groups):
            try:
                self.control.call(url, "/destroy_weights_update_group", {"group_name": name})
            except WeightSyncError:
                pass
            dist.destroy_process_group(group)
        self.groups, self._stores = [], []

    def _send(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        bucket = [(name, t.to(self.dtype)) for name, t in bucket]
        flat = flatten(bucket)
        # Before any post: the TP all_gathers that built this bucket must have run. Else (GPUs,
        # TP > 1) this owner's broadcast could queue behind a gather that rank 0 has not
        # enqueued, while rank 0 waits for the server this owner just posted to: a cycle
        # (SGLang's update_weights_from_distributed answers before its broadcast completes).
        settle(flat)
        body = {"names": [n for n, _ in bucket], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket], "flush_cache": False, "load_format": "flattened_bucket"}
        with ThreadPoolExecutor(max_workers=1) as pool:
            for url, (name, group) in zip(self.control.urls, self.groups):
                answer = pool.submit(self.control.call, url, "/update_weights_from_distributed", {**body, "group_name": name})
                dist.broadcast(flat, group_src=0, group=group)
                answer.result()

    def push(self, weight_version: str) -> int:
        """Send every weight; afterwards the servers generate with them, tagged `weight_version`.
        Returns the bytes this rank sent (per server)."""
        sent = 0
        with update_session(self.control, weight_version):
            # Every rank iterates: the export gathers TP shards collectively.
            for bucket in bucketed(owned_hf_weights(self.model, self.arch, self.spec), self.bucket_bytes, self.dtype):
                self._send(bucket)
                sent += sum(t.numel() for _, t in bucket) * self.dtype.itemsize
        return sent
