"""Proof that a push worked: the engine's log-probs of probe sequences against the trainer's."""

from __future__ import annotations

import torch
import torch.distributed as dist

from gspo_mcore.errors import WeightSyncError
from gspo_mcore.rollout.engine_control import EngineControl


def check_sync(model, control: EngineControl, probes: list[list[int]], median_tolerance: float) -> dict:
    """Every server's log-probs of `probes` (one prefill each) against the trainer's forward of
    the same tokens. Collective; returns the figures (the worst server's) on every rank and
    raises WeightSyncError naming the server when its median difference exceeds
    `median_tolerance` (a wrong, stale or renumbered tensor moves most tokens by ~1; bf16
    noise is a few 0.01)."""
    from gspo_mcore.models.qwen3_moe.forward import last_stage_rank, sequence_logprobs

    last = last_stage_rank()
    ours = sequence_logprobs(model, probes)
    found = [None]
    if dist.get_rank() == last:
        ours = torch.cat([torch.tensor(values) for values in ours])
        per_server = []
        for url in control.urls:
            engine = torch.cat([torch.tensor(values) for values in control.prompt_logprobs(url, probes)])
            d = (ours - engine).abs()
            per_server.append((url, {"sync_check_median": d.median().item(), "sync_check_max": d.max().item(),
                                     "sync_check_within_0.1": (d < 0.1).float().mean().item()}))
        found = [max(per_server, key=lambda item: item[1]["sync_check_median"])]
    dist.broadcast_object_list(found, src=last)
    url, stats = found[0]
    if stats["sync_check_median"] > median_tolerance:
        raise WeightSyncError(
            f"weight sync check: server {url}'s log-probs differ from the trainer's by {stats['sync_check_median']:.3g} "
            f"(median over probe tokens; tolerance {median_tolerance}): the pushed weights are not the trainer's"
        )
    return stats
