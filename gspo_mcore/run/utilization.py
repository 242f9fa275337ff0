"""The trainer's `mfu` and `hfu`: a step's FLOPs (gspo_mcore.planner.flops) per second of its
training (time_train_s) per trainer GPU, over the GPU's dense bf16 peak."""

from __future__ import annotations

from typing import Callable

import torch

from gspo_mcore.batch.rollout import Rollout
from gspo_mcore.config import Config
from gspo_mcore.megatron.qwen3_moe.hf_config import Qwen3MoeArch
from gspo_mcore.planner.costs import forward_passes
from gspo_mcore.planner.flops import peak_flops, update_flops, utilization


def device_peak_flops(config: Config, say: Callable[[str], None]) -> float | None:
    """The trainer GPUs' peak: None on CPU (no peak to divide by) and for a GPU the table does not
    know, which `say` reports once, at start."""
    if config.distributed.device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    peak = peak_flops(name)
    if peak is None:
        say(f"mfu / hfu: no dense bf16 peak known for {name} (gspo_mcore.planner.flops.PEAK_BF16_FLOPS): "
            "reported null")
    return peak


def step_utilization(config: Config, arch: Qwen3MoeArch, rollouts: list[Rollout], seconds: float, gpus: int,
                     peak: float | None) -> dict[str, float | None]:
    """`mfu` (model FLOPs: the paper-standard count the published figures use) and `hfu` (hardware
    FLOPs: + the recomputed forwards and the forward-only passes of the batch) of a step that
    trained `rollouts` in `seconds` on `gpus` GPUs; null without a peak."""
    if peak is None:
        return {"mfu": None, "hfu": None}
    lengths = [len(r.prompt_ids) + len(r.response_ids) for r in rollouts]
    flops = update_flops(config, arch, lengths, sum(forward_passes(config).values()))
    return {"mfu": utilization(flops.model, seconds, gpus, peak), "hfu": utilization(flops.hardware, seconds, gpus, peak)}
