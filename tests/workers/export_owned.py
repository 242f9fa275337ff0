"""Export the tiny model's weights from a sharded layout, each tensor on its one owner rank,
in buckets; each rank saves what it got to OUT_DIR/rank{R}.pt."""

import sys

import torch
import torch.distributed as dist

from gspo_mcore.config import load_config
from gspo_mcore.models.qwen3_moe.bootstrap import model_from_config
from gspo_mcore.models.qwen3_moe.parallel_weights import owned_hf_weights
from gspo_mcore.weight_sync import bucketed

BUCKET_BYTES = 100_000


def main(hf_dir: str, out_dir: str, overrides: list[str]) -> None:
    config = load_config(None, [f"model.hf_dir={hf_dir}", *overrides])
    arch, model = model_from_config(config)
    buckets = [[(name, t.clone()) for name, t in bucket]
               for bucket in bucketed(owned_hf_weights(model, arch, config.model.spec), BUCKET_BYTES)]
    torch.save(buckets, f"{out_dir}/rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
