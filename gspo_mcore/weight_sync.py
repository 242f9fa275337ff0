"""Trainer -> inference engine weight transfer.

The trainer's weights leave as Hugging Face tensors (`owned_hf_weights`: TP shards gathered,
global expert ids, every pipeline stage; each tensor on exactly one rank), in buckets of
bounded size, streamed. Three paths to SGLang:
- `DistributedWeightSync`: each rank that owns tensors broadcasts its buckets to the servers
  over its own process group (NCCL on GPUs, gloo on CPU) inside SGLang's weight-update session;
- `TensorWeightSync` (colocated): each server TP rank reads every bucket from the trainer rank
  on its own GPU (`/update_weights_from_tensor`, CUDA IPC);
- `push_from_disk`: an HF checkpoint on a shared file system + `/update_weights_from_disk`.
`check_sync` proves a push worked: the engine's log-probs of probe sequences against the trainer's.
"""

from __future__ import annotations

import math
import os
import socket
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
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


@contextmanager
def update_session(control: EngineControl, weight_version: str):
    """SGLang's weight-update session around a push by all trainer ranks (collective): rank 0
    opens it once every rank is ready and closes it, tagging `weight_version`, once every rank
    has sent."""
    if dist.get_rank() == 0:
        control.begin_update()
    dist.barrier()
    yield
    dist.barrier()
    if dist.get_rank() == 0:
        control.end_update(weight_version)
    dist.barrier()


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

        sent = 0
        with update_session(self.control, weight_version):
            # Every rank iterates: the export gathers TP shards collectively.
            for bucket in bucketed(owned_hf_weights(self.model, self.arch, self.spec), self.bucket_bytes, self.dtype):
                self._send(bucket)
                sent += sum(t.numel() for _, t in bucket) * self.dtype.itemsize
        return sent


def _host_addresses(host: str) -> set[str]:
    try:
        return {host, socket.gethostbyname(host)}
    except OSError:
        return {host}


def where_ranks_run() -> list[tuple[set[str], int]]:
    """(names and addresses of its host, LOCAL_RANK) of every trainer rank. Collective."""
    mine = (_host_addresses(socket.gethostname()) | _host_addresses(socket.getfqdn()),
            int(os.environ.get("LOCAL_RANK", 0)))
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    return ranks


def colocated_readers(urls: list[str], tps: list[int], ranks: list[tuple[set[str], int]]) -> list[list[int]]:
    """For each server, the trainer ranks whose GPUs its TP ranks run on: the i-th server of a
    host (URL order) on that host's GPUs i * tp .. i * tp + tp - 1, matched to the trainer
    ranks (`where_ranks_run`, in any rank order) with those LOCAL_RANKs on that host."""
    from urllib.parse import urlparse

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
        from gspo_mcore.parallel import device

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
        from sglang.srt.utils import MultiprocessingSerializer

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
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

        from gspo_mcore.parallel import device

        metadata, start = [], 0
        for name, shape in layout:
            size = math.prod(shape) * self.dtype.itemsize
            metadata.append(FlattenedTensorMetadata(name=name, shape=torch.Size(shape), dtype=self.dtype,
                                                    start_idx=start, end_idx=start + size, numel=size))
            start += size
        mine = dist.get_rank() == src
        flat = _flatten(bucket) if mine else torch.empty(start, dtype=torch.uint8, device=device())
        dist.broadcast(flat, src=src)
        self._load_everywhere(flat, metadata)
        return start if mine else 0

    def push(self, weight_version: str) -> int:
        """Send every weight; afterwards the servers generate with them, tagged `weight_version`.
        Returns the bytes this rank owned."""
        from gspo_mcore.models.qwen3_moe.parallel_weights import export_hf_weights, owns

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
            targets = torch.tensor(seq[1:], device=logits.device)[:, None]
            diffs.append(logits[0, : len(seq) - 1].float().log_softmax(-1).gather(-1, targets)[:, 0].cpu())
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
