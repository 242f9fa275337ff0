"""The engine's routed experts (`rollout.return_routed_experts`) from rank 0 to the ranks that
read them: each rank gets its own rollouts' rows (those its data-parallel shards hold) for its
own MoE layers (its pipeline stage's), not the whole batch's. At the 30B shape a response of 8k
tokens carries 8k x 48 layers x 8 experts, 3 MB as uint8; broadcast whole, a 512-response
batch was ~1.5 GB pickled to every rank.

Rank 0 takes the routing off the batch before it is broadcast (`take_routing`); then every
rank says what it reads (its rollouts from `Learner.routing_wanted`, its layers from
`RouterHooks.layers`), rank 0 cuts each rank its part, and each rank puts it back on its
rollouts (`deliver_routing`). Both exchanges go over the host (gloo) group.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from gspo_mcore.megatron.parallel import gather_to_host, scatter_from_host
from gspo_mcore.batch.rollout import Batch


def take_routing(batch: Batch) -> tuple[Batch, list[np.ndarray | None]]:
    """(the batch without routed experts, each rollout's routed experts [tokens, layers, top-k])."""
    routing = [r.routed_experts for r in batch.rollouts]
    rollouts = [dataclasses.replace(r, routed_experts=None) for r in batch.rollouts]
    return dataclasses.replace(batch, rollouts=rollouts), routing


def cut(routing: list[np.ndarray | None], rollouts: list[int], layers: list[int]) -> dict[int, np.ndarray]:
    """`rollouts`' routing, only rows of `layers` (the engine's layer rows), each contiguous."""
    return {i: np.ascontiguousarray(routing[i][:, layers]) for i in rollouts if routing[i] is not None}


def deliver_routing(batch: Batch, routing: list[np.ndarray | None] | None, rollouts: list[int],
                    layers: list[int]) -> float | None:
    """Collective on the host group: this rank's `rollouts` of `batch` get their routed experts
    for `layers` (`routing`: every rollout's, given on rank 0 only). Returns, on rank 0, the MB
    the busiest rank got (None elsewhere)."""
    wanted = gather_to_host((sorted(rollouts), list(layers)))
    parts = [cut(routing, *want) for want in wanted] if wanted is not None else None
    mine = scatter_from_host(parts)
    for i, rows in mine.items():
        batch.rollouts[i] = dataclasses.replace(batch.rollouts[i], routed_experts=rows)
    if parts is None:
        return None
    return max(sum(rows.nbytes for rows in part.values()) for part in parts) / 2**20
