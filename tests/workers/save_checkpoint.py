"""Save the tiny model with Megatron's own dist_checkpointing under a parallel layout, as
the trainer does: SAVE_ROOT/iter_0000001 + latest_checkpointed_iteration.txt."""

import sys
from pathlib import Path

import torch.distributed as dist
from megatron.core import dist_checkpointing

from gspo_mcore.config import load_config
from gspo_mcore.megatron.qwen3_moe.bootstrap import model_from_config


def main(hf_dir: str, save_root: str, overrides: list[str]) -> None:
    config = load_config(None, [f"model.hf_dir={hf_dir}", *overrides])
    _, model = model_from_config(config)
    iteration_dir = Path(save_root) / "iter_0000001"
    if dist.get_rank() == 0:
        iteration_dir.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), str(iteration_dir))
    if dist.get_rank() == 0:
        (Path(save_root) / "latest_checkpointed_iteration.txt").write_text("1")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
