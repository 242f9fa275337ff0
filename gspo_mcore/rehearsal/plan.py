"""The routing plan: what the expert dispatch reads on the host, answered without the router's real
choices (a fake router has none).

megatron-core 0.16.1's all-to-all dispatcher (transformer/moe/token_dispatcher.py,
MoEAlltoAllTokenDispatcher) copies its per-expert and per-rank token counts to the host
(`_maybe_dtoh_and_synchronize` -> moe_utils.py `maybe_move_tensor_to_cpu`: tokens_per_expert,
input_splits, output_splits, output_splits_tp, num_global_tokens_per_local_expert) and sizes its
permutations from them (moe_utils.py `permute`: `masked_select` of the routing map). The plan gives
those counts: this rank sends each token's k copies evenly over the expert ranks, and receives
`imbalance` times its share (default 2: the no-aux-loss worst case the planner assumes,
memory_model.EXPERT_IMBALANCE), capped by what a rank can receive (a token sends it at most
min(k, local experts) of its copies). Dropless top-k: the routing map's mask selects exactly
tokens x k entries, one per received copy on the expert side.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def spread(total: int, parts: int) -> list[int]:
    """`total` in `parts` integers as even as they go (the first ones one larger)."""
    base, extra = divmod(int(total), parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


@dataclass(frozen=True)
class RoutingPlan:
    num_experts: int
    topk: int
    expert_parallel: int
    tensor_parallel: int = 1  # the dispatcher's: expert-tensor-parallel (its tp_ep group's TP)
    imbalance: float = 2.0

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.expert_parallel

    def effective_imbalance(self) -> float:
        """`imbalance`, capped by what one expert rank can receive (memory_model.expert_imbalance's cap)."""
        cap = min(self.topk, self.local_experts) * self.expert_parallel / self.topk
        return max(1.0, min(self.imbalance, cap))

    def received(self, local_tokens: int) -> int:
        """Routed copies this rank's experts receive from each source rank's `local_tokens` tokens,
        summed over the expert ranks."""
        share = local_tokens * self.topk / self.expert_parallel  # per source, balanced
        return int(round(share * self.effective_imbalance())) * self.expert_parallel

    def dispatcher_counts(self, local_tokens: int) -> dict[str, np.ndarray]:
        """The dispatcher's host copies for a microbatch of `local_tokens` tokens on this rank, by
        the dispatcher's attribute names."""
        ep, tp, local = self.expert_parallel, self.tensor_parallel, self.local_experts
        per_source = self.received(local_tokens) // ep
        per_expert = np.array([spread(per_source, local) for _ in range(ep * tp)], dtype=np.int64)  # [tp*ep, local]
        output_splits = per_expert.sum(axis=1)[:ep]
        return {"input_splits": np.array(spread(local_tokens * self.topk, ep), dtype=np.int64),
                "output_splits": output_splits,
                "output_splits_tp": np.full(tp, output_splits.sum(), dtype=np.int64),
                "num_global_tokens_per_local_expert": per_expert,
                "tokens_per_expert": per_expert.sum(axis=0)}

    def masked_count(self, mask_shape: tuple[int, ...]) -> int | None:
        """Entries a routing map of `mask_shape` ([experts, tokens], permute's transposed mask)
        selects: k per token over all experts, one per received copy over the local ones; None
        for another mask (not the plan's to answer)."""
        if len(mask_shape) != 2:
            return None
        experts, tokens = mask_shape
        if experts == self.num_experts:
            return tokens * self.topk
        if experts == self.local_experts:
            return tokens
        return None
