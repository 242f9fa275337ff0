"""Proof that a push worked: the engine's log-probs of probe sequences (`SyncProbe.prompt_logprobs`)
against the trainer's."""

from __future__ import annotations

import torch
import torch.distributed as dist

from gspo_mcore.common.errors import WeightSyncError
from gspo_mcore.megatron.qwen3_moe.forward import last_stage_rank, sequence_logprobs
from gspo_mcore.megatron.parallel import broadcast_from_host


def check_sync(model, engine, probes: list[list[int]], median_tolerance: float,
               scored_from: list[int] | None = None, fused_logprobs: bool = False) -> dict:
    """Every server's log-probs of `probes` (one prefill each) against the trainer's forward of
    the same tokens, from token `scored_from[i]` of probe i on (a rollout's response: its own
    tokens are likely ones; a prompt's unlikely tokens spread bf16 noise to ~0.1). Collective;
    returns the figures (the worst server's) on every rank and raises WeightSyncError naming the
    server when its median difference exceeds `median_tolerance` (a wrong, stale or renumbered
    tensor moves most tokens by ~1). `fused_logprobs`: the trainer's forward as its training's
    (model.fused_logprobs: no [tokens, vocabulary] logits, as the planner counts this phase)."""
    last = last_stage_rank()
    ours = sequence_logprobs(model, probes, fused_logprobs=fused_logprobs)
    found = [None]
    if dist.get_rank() == last:
        starts = [max(0, first - 1) for first in scored_from] if scored_from else [0] * len(probes)  # log-prob t: token t+1

        def scored(values_per_probe):  # lists from the forward and from HTTP answers
            return torch.cat([torch.tensor(v[start:]) for v, start in zip(values_per_probe, starts)])  # host: compared here

        ours = scored(ours)
        per_server = []
        for url in engine.urls:
            theirs = scored(engine.prompt_logprobs(url, probes))
            d = (ours - theirs).abs()
            per_server.append((url, {"sync_check_median": d.median().item(), "sync_check_max": d.max().item(),
                                     "sync_check_within_0.1": (d < 0.1).float().mean().item()}))
        found = [max(per_server, key=lambda item: item[1]["sync_check_median"])]
    # The other ranks wait on the host group while `last` asks the servers over HTTP: an NCCL
    # broadcast would spin on their GPUs and time out behind a slow engine.
    url, stats = broadcast_from_host(found[0], src=last)
    if stats["sync_check_median"] > median_tolerance:
        raise WeightSyncError(
            f"weight sync check: server {url}'s log-probs differ from the trainer's by {stats['sync_check_median']:.3g} "
            f"(median over probe tokens; tolerance {median_tolerance}): the pushed weights are not the trainer's"
        )
    return stats
