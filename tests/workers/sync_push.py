"""Push trainer weights into running SGLang servers, twice, and check each push with
check_sync; also check that a stale engine is caught. METHOD: distributed (process groups,
gloo), relayed (the same through trainer rank 0 only, as for an engine that takes one sender:
vLLM) or tensor (the colocated path: each rank's copy through shared memory).
argv: METHOD URL[,URL...] HF_DIR_1 HF_DIR_2 [overrides]. Prints one JSON line per push."""

import json
import sys

import torch
import torch.distributed as dist

from gspo_mcore.common.safetensors_io import HFCheckpointReader
from gspo_mcore.config import load_config
from gspo_mcore.megatron.qwen3_moe.bootstrap import model_from_config
from gspo_mcore.megatron.qwen3_moe.parallel_weights import load_hf_weights
from gspo_mcore.common.errors import WeightSyncError
from gspo_mcore.engines.sglang.engine import SGLangEngine
from gspo_mcore.weight_sync import DistributedWeightSync, TensorWeightSync, check_sync



class OneSender(SGLangEngine):
    """SGLang taking weights from trainer rank 0 only, as vLLM's transfer engine does."""
    single_sender = True


PROBES = [[1, 5, 9, 33, 7, 2, 90, 14], [200, 3, 4, 5, 6, 7, 8], [42, 42, 17, 250, 31]]


def main(method: str, urls: str, first: str, second: str, overrides: list[str]) -> None:
    config = load_config(None, [f"model.hf_dir={first}", *overrides])
    arch, model = model_from_config(config)
    control = (OneSender if method == "relayed" else SGLangEngine)(urls.split(","))
    # 64 KiB buckets: many buckets per push, and tensors larger than a bucket.
    if method in ("distributed", "relayed"):
        sync = DistributedWeightSync(model, arch, config.model.spec, control, backend="gloo", master_address="127.0.0.1",
                                     bucket_bytes=64 << 10, dtype=torch.bfloat16, group_timeout_s=120)
    else:
        sync = TensorWeightSync(model, arch, config.model.spec, control, bucket_bytes=64 << 10, dtype=torch.bfloat16)
    for version, hf_dir in (("step-1", first), ("step-2", second)):
        load_hf_weights(model, arch, config.model.spec, HFCheckpointReader(hf_dir).__getitem__)
        if version == "step-2":  # the engine still has step-1's weights: the check must see it
            try:
                check_sync(model, control, PROBES, median_tolerance=0.03)
                stale = "not detected"
            except WeightSyncError as err:
                stale = str(err)
        sent = sync.push(version)
        stats = check_sync(model, control, PROBES, median_tolerance=0.03)
        if dist.get_rank() == 0:
            print(json.dumps({"version": version, "bytes_sent_rank0": sent, **stats,
                              **({"stale": stale} if version == "step-2" else {})}), flush=True)
    if method in ("distributed", "relayed"):
        sync.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:])
