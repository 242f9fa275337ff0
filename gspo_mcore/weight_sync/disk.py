"""Push through a Hugging Face checkpoint on a shared file system (written by the checkpointer's
`save_hf_checkpoint`) and `/update_weights_from_disk`."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from gspo_mcore.checkpointing import save_hf_checkpoint
from gspo_mcore.rollout.engine_control import EngineControl


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
