"""Load an HF checkpoint into the sharded model and write it back with save_hf_checkpoint."""

import sys

import torch.distributed as dist

from checkpoint_convert.safetensors_io import HFCheckpointReader
from gspo_mcore.config import load_config
from gspo_mcore.models.qwen3_moe.hf_config import load_hf_config
from gspo_mcore.models.qwen3_moe.model import build_model
from gspo_mcore.models.qwen3_moe.parallel_weights import load_hf_weights
from gspo_mcore.parallel import init_distributed
from gspo_mcore.weight_sync import save_hf_checkpoint


def main(hf_dir: str, out_dir: str, overrides: list[str]) -> None:
    config = load_config(None, [f"model.hf_dir={hf_dir}", *overrides])
    init_distributed(config.distributed)
    arch = load_hf_config(hf_dir)
    model = build_model(arch, config.model, config.distributed)
    load_hf_weights(model, arch, config.model.spec, HFCheckpointReader(hf_dir).__getitem__)
    save_hf_checkpoint(model, arch, config.model.spec, out_dir, hf_dir)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
