"""Export the tiny model's weights from a sharded layout, each tensor on its one owner rank,
in buckets; each rank saves what it got to OUT_DIR/rank{R}.pt."""

import sys

import torch
import torch.distributed as dist

from checkpoint_convert.safetensors_io import HFCheckpointReader
from gspo_mcore.config import load_config
from gspo_mcore.models.qwen3_moe.hf_config import load_hf_config
from gspo_mcore.models.qwen3_moe.model import build_model
from gspo_mcore.models.qwen3_moe.parallel_weights import load_hf_weights, owned_hf_weights
from gspo_mcore.parallel import init_distributed
from gspo_mcore.weight_sync import bucketed

BUCKET_BYTES = 100_000


def main(hf_dir: str, out_dir: str, overrides: list[str]) -> None:
    config = load_config(None, [f"model.hf_dir={hf_dir}", *overrides])
    init_distributed(config.distributed)
    arch = load_hf_config(hf_dir)
    model = build_model(arch, config.model, config.distributed)
    load_hf_weights(model, arch, config.model.spec, HFCheckpointReader(hf_dir).__getitem__)
    buckets = [[(name, t.clone()) for name, t in bucket]
               for bucket in bucketed(owned_hf_weights(model, arch, config.model.spec), BUCKET_BYTES)]
    torch.save(buckets, f"{out_dir}/rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
