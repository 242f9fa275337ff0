"""Trainer -> inference engine weight transfer: the trainer's weights as Hugging Face tensors
in buckets of bounded size (the push to SGLang builds on this)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterable, Iterator

import torch


def bucketed(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group (name, tensor) pairs, in order, into lists of at most `bucket_bytes` (a tensor
    larger than that travels alone). Streams: one bucket is held at a time."""
    bucket, size = [], 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
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

    import torch.distributed as dist

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


def push_from_disk(url: str, hf_dir, weight_version: str, timeout_s: float = 600.0) -> None:
    """Ask an SGLang server to load the checkpoint `hf_dir` (a file system both can see)
    and to tag what it generates from now on with `weight_version`."""
    import json
    import urllib.error
    import urllib.request

    from gspo_mcore.errors import InputError

    body = json.dumps({"model_path": str(hf_dir), "weight_version": weight_version}).encode()
    request = urllib.request.Request(f"{url.rstrip('/')}/update_weights_from_disk", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            answer = json.loads(response.read())
    except (urllib.error.URLError, OSError) as err:
        raise InputError(f"weight sync: server {url} did not take {hf_dir}: {err}") from None
    if not answer.get("success", False):
        raise InputError(f"weight sync: server {url} refused {hf_dir}: {answer.get('message', answer)}")
