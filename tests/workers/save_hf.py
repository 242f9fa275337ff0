"""Load an HF checkpoint into the sharded model and write it back with save_hf_checkpoint."""

import sys

import torch.distributed as dist

from gspo_mcore.config import load_config
from gspo_mcore.models.qwen3_moe.bootstrap import model_from_config
from gspo_mcore.weight_sync import save_hf_checkpoint


def main(hf_dir: str, out_dir: str, overrides: list[str]) -> None:
    config = load_config(None, [f"model.hf_dir={hf_dir}", *overrides])
    arch, model = model_from_config(config)
    save_hf_checkpoint(model, arch, config.model.spec, out_dir, hf_dir)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
