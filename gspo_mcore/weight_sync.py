"""Trainer -> inference engine weight transfer.

The trainer's weights leave as Hugging Face tensors (`owned_hf_weights`: TP shards gathered,
global expert ids, every pipeline stage; each tensor on exactly one rank), in buckets of
bounded size, streamed. Two paths to SGLang:
- `DistributedWeightSync`: each rank that owns tensors broadcasts its buckets to the servers
  over its own process group (NCCL on GPUs, gloo on CPU) inside SGLang's weight-update session;
- `push_from_disk`: an HF checkpoint on a shared file system + `/update_weights_from_disk`.
`check_sync` proves a push worked: the engine's log-probs of probe sequences against the trainer's.
"""

from __future__ import annotations

import math
import socket
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Iterable, Iterator

import torch
import torch.distributed as dist

from gspo_mcore.rollout.engine_control import EngineControl, WeightSyncError


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


def save_hf_checkpoint(model, arch, spec: str, out_dir, hf_config_dir) -> Path:
    """Write the trainer's current weights as a Hugging Face checkpoint (safetensors shards
    + index + the config/tokenizer files of `hf_config_dir`), each rank writing the tensors it
    owns, streamed. Collective. Written to a temporary sibling and renamed when complete;
    the disk path of weight sync (`/update_weights_from_disk`) and the final HF export."""
    import shutil

    from checkpoint_convert.safetensors_io import HFCheckpointWriter, copy_side_files, write_index_file
    from gspo_mcore.models.qwen3_moe.parallel_weights import owned_hf_plan, owned_hf_weights

    out_dir = Path(out_dir)
    rank = dist.get_rank()
    tmp = out_dir.with_name(f"{out_dir.name}.tmp-sync")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    plan = owned_hf_plan(model, arch, spec)
    counts = [None] * dist.get_world_size()
    dist.all_gather_object(counts, HFCheckpointWriter(tmp, plan).num_shards)
    writer = HFCheckpointWriter(tmp, plan, first_shard=sum(counts[:rank]), total_shards=sum(counts))
    for name, tensor in owned_hf_weights(model, arch, spec):
        writer.write(name, tensor)
    writer.finish(write_index=False)
    maps = [None] * dist.get_world_size()
    dist.all_gather_object(maps, (writer.weight_map, sum(t.itemsize * math.prod(s) for _, t, s in plan)))
    if rank == 0:
        write_index_file(tmp, {k: v for m, _ in maps for k, v in m.items()}, sum(size for _, size in maps))
        copy_side_files(hf_config_dir, tmp)
        shutil.rmtree(out_dir, ignore_errors=True)
        tmp.rename(out_dir)
    dist.barrier()
    return out_dir


def push_from_disk(control: EngineControl, hf_dir, weight_version: str) -> None:
    """Every server loads the checkpoint `hf_dir` (a file system both can see) and tags what
    it generates from now on with `weight_version` (the load flushes its cache)."""
    control.on_all("/update_weights_from_disk", {"model_path": str(hf_dir), "weight_version": weight_version})


def _flatten(bucket: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """SGLang's "flattened_bucket" layout: the tensors' bytes, concatenated in order."""
    return torch.cat([t.contiguous().view(-1).view(torch.uint8) for _, t in bucket])


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
        from gspo_mcore.models.qwen3_moe.parallel_weights import owned_hf_plan

        if master_address == "auto":  # multi-node: each owner rank hosts its groups' store
            master_address = socket.gethostbyname(socket.getfqdn())
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
        from sglang.srt.utils import init_custom_process_group

        world_size = 1 + self.control.tp_size(url)
        # Our own store, not a tcp:// init_method: under torchrun that would connect to the
        # elastic agent's store instead of hosting one (TORCHELASTIC_USE_AGENT_STORE).
        store = dist.TCPStore(master_address, 0, world_size, is_master=True,
                              timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
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
        flat = _flatten(bucket)
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
        from gspo_mcore.models.qwen3_moe.parallel_weights import owned_hf_weights

        if dist.get_rank() == 0:
            self.control.begin_update()
        dist.barrier()
        sent = 0
        # Every rank iterates: the export gathers TP shards collectively.
        for bucket in bucketed(owned_hf_weights(self.model, self.arch, self.spec), self.bucket_bytes, self.dtype):
            self._send(bucket)
            sent += sum(t.numel() for _, t in bucket) * self.dtype.itemsize
        dist.barrier()
        if dist.get_rank() == 0:
            self.control.end_update(weight_version)
        dist.barrier()
        return sent


def check_sync(model, control: EngineControl, probes: list[list[int]], median_tolerance: float) -> dict:
    """The engine's log-probs of `probes` (one prefill each) against the trainer's forward of
    the same tokens. Collective; returns the figures on every rank and raises WeightSyncError
    when the median difference exceeds `median_tolerance` (a wrong, stale or renumbered
    tensor moves most tokens by ~1; bf16 noise is a few 0.01)."""
    from gspo_mcore.parity import megatron_logits

    last = dist.get_world_size() - 1  # in Megatron's rank order the last rank is on the last stage
    diffs = []
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    for seq in probes:
        # Padded on the right to a multiple of TP (sequence parallel); causal, so harmless.
        logits = megatron_logits(model, torch.tensor([seq + [0] * (-len(seq) % tp)]))
        if dist.get_rank() == last:
            ours = logits[0, : len(seq) - 1].float().log_softmax(-1).gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]
            diffs.append(ours)
    stats = [None]
    if dist.get_rank() == last:
        engine = control.prompt_logprobs(control.urls[0], probes)
        d = torch.cat([(ours - torch.tensor(theirs)).abs() for ours, theirs in zip(diffs, engine)])
        stats = [{"sync_check_median": d.median().item(), "sync_check_max": d.max().item(),
                  "sync_check_within_0.1": (d < 0.1).float().mean().item()}]
    dist.broadcast_object_list(stats, src=last)
    if stats[0]["sync_check_median"] > median_tolerance:
        raise WeightSyncError(
            f"weight sync check: the engine's log-probs differ from the trainer's by {stats[0]['sync_check_median']:.3g} "
            f"(median over probe tokens; tolerance {median_tolerance}): the pushed weights are not the trainer's"
        )
    return stats[0]
