"""Push through a Hugging Face checkpoint on a shared file system (written by the checkpointer's
`save_hf_checkpoint`) that every server loads (`DiskLoad.load_from_disk`)."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from gspo_mcore.megatron.checkpointing import save_hf_checkpoint


class DiskWeightSync:
    """Every push writes the trainer's weights as an HF checkpoint to `disk_dir` (a file system
    the servers see) and has every server load it. Collective."""

    def __init__(self, model, arch, spec: str, engine, *, disk_dir: Path, hf_config_dir: str):
        self.model, self.arch, self.spec, self.engine = model, arch, spec, engine
        self.disk_dir, self.hf_config_dir = Path(disk_dir), hf_config_dir

    def push(self, weight_version: str) -> None:
        save_hf_checkpoint(self.model, self.arch, self.spec, self.disk_dir, self.hf_config_dir)
        if dist.get_rank() == 0:
            self.engine.load_from_disk(self.disk_dir, weight_version)
        dist.barrier()

    def close(self) -> None:
        pass
