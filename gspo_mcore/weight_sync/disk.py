"""Push through a Hugging Face checkpoint on a shared file system; also the final HF export."""

from __future__ import annotations

import math
from pathlib import Path

import torch.distributed as dist

from gspo_mcore.rollout.engine_control import EngineControl


def save_hf_checkpoint(model, arch, spec: str, out_dir, hf_config_dir) -> Path:
    """Write the trainer's current weights as a Hugging Face checkpoint (safetensors shards
    + index + the config/tokenizer files of `hf_config_dir`), each rank writing the tensors it
    owns, streamed. Collective. Written to a temporary sibling and renamed when complete;
    the disk path of weight sync (`/update_weights_from_disk`) and the final HF export."""
    from gspo_mcore.files import atomic_output_all_ranks

    out_dir = Path(out_dir)
    with atomic_output_all_ranks(out_dir) as tmp:
        _write_hf_checkpoint(model, arch, spec, tmp, hf_config_dir)
    return out_dir


def _write_hf_checkpoint(model, arch, spec: str, tmp: Path, hf_config_dir) -> None:
    from gspo_mcore.safetensors_io import HFCheckpointWriter, copy_side_files, write_index_file
    from gspo_mcore.models.qwen3_moe.parallel_weights import owned_hf_plan, owned_hf_weights

    rank = dist.get_rank()
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


def push_from_disk(control: EngineControl, hf_dir, weight_version: str) -> None:
    """Every server loads the checkpoint `hf_dir` (a file system both can see) and tags what
    it generates from now on with `weight_version` (the load flushes its cache)."""
    control.on_all("/update_weights_from_disk", {"model_path": str(hf_dir), "weight_version": weight_version})


class DiskWeightSync:
    """Every push writes the trainer's weights as an HF checkpoint to `disk_dir` (a file system
    the servers see) and has every server load it. Collective."""

    def __init__(self, model, arch, spec: str, control: EngineControl, *, disk_dir: Path, hf_config_dir: str):
        self.model, self.arch, self.spec, self.control = model, arch, spec, control
        self.disk_dir, self.hf_config_dir = Path(disk_dir), hf_config_dir

    def push(self, weight_version: str) -> None:
        save_hf_checkpoint(self.model, self.arch, self.spec, self.disk_dir, self.hf_config_dir)
        if dist.get_rank() == 0:
            push_from_disk(self.control, self.disk_dir, weight_version)
        dist.barrier()

    def close(self) -> None:
        pass
