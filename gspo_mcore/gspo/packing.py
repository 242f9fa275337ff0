"""Sequences -> minibatches -> data-parallel shards -> microbatches -> tensors, as pure functions.

Every sequence stays whole inside one microbatch. A microbatch costs its padded size
(sequences x longest length), which `max_tokens` bounds; a sequence longer than the budget
travels alone.
"""

from __future__ import annotations

from typing import Sequence

import torch


def split_minibatches(num_samples: int, num_minibatches: int) -> list[list[int]]:
    """Consecutive, near-equal slices of the (already shuffled) sample order."""
    base, extra = divmod(num_samples, num_minibatches)
    out, start = [], 0
    for i in range(num_minibatches):
        size = base + (i < extra)
        out.append(list(range(start, start + size)))
        start += size
    return out


def balance_across_ranks(indices: list[int], lengths: list[int], num_ranks: int) -> list[list[int]]:
    """Longest first to the rank with the fewest tokens (ties: fewest sequences), so DP ranks
    get near-equal work; every rank gets at least one sequence when there are enough."""
    if len(indices) < num_ranks:
        raise ValueError(f"{len(indices)} sequences cannot feed {num_ranks} data-parallel ranks")
    shards: list[list[int]] = [[] for _ in range(num_ranks)]
    tokens = [0] * num_ranks
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        rank = min(range(num_ranks), key=lambda r: (tokens[r], len(shards[r]), r))
        shards[rank].append(i)
        tokens[rank] += lengths[i]
    return [sorted(s) for s in shards]


def pack_microbatches(indices: list[int], lengths: list[int], max_tokens: int) -> list[list[int]]:
    """First-fit decreasing by length into microbatches whose padded size
    (count x longest) stays within `max_tokens`."""
    microbatches: list[list[int]] = []
    longest: list[int] = []
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        for m, members in enumerate(microbatches):
            # Sorted decreasing: the first member is the longest, so adding i keeps it.
            if (len(members) + 1) * longest[m] <= max_tokens:
                members.append(i)
                break
        else:
            microbatches.append([i])
            longest.append(lengths[i])
    return microbatches


def sequence_lengths(rollouts) -> list[int]:
    """Model input length of each rollout (prompt + response, minus the last token)."""
    return [len(r.prompt_ids) + len(r.response_ids) - 1 for r in rollouts]


def spread_over_response(values: Sequence[float], mask: Sequence[float]) -> list[float]:
    """Values of the masked-in response tokens (in order) -> one per response token, 0 where the
    mask is 0 (an environment's tokens), the layout of `Rollout.logprobs`."""
    trained = sum(1 for m in mask if m)
    if len(values) != trained:
        raise ValueError(f"{len(values)} values for {trained} masked-in tokens")
    it = iter(values)
    return [next(it) if m else 0.0 for m in mask]


def response_aligned(rollouts, values: Sequence[Sequence[float]], width: int) -> torch.Tensor:
    """Per-response-token values [B, width] at the positions that predict those tokens
    (position t predicts token t + 1), zero elsewhere."""
    out = torch.zeros(len(rollouts), width)
    for i, (r, v) in enumerate(zip(rollouts, values)):
        first = len(r.prompt_ids) - 1
        out[i, first : first + len(r.response_ids)] = torch.tensor(v, dtype=torch.float32)
    return out


def collate(rollouts, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded training tensors. `tokens` [B, L + 1] holds prompt + response; position
    t of `old_logprobs` / `mask` [B, L] belongs to the token at t + 1 (the one predicted
    from positions <= t), so mask is 1 exactly where a response token the model generated is
    predicted (an environment's tokens in a multi-turn trajectory: 0)."""
    length = max(len(r.prompt_ids) + len(r.response_ids) for r in rollouts)
    tokens = torch.full((len(rollouts), length), pad_id, dtype=torch.long)
    for i, r in enumerate(rollouts):
        tokens[i, : len(r.prompt_ids) + len(r.response_ids)] = torch.tensor(r.prompt_ids + r.response_ids)
    return {"tokens": tokens,
            "old_logprobs": response_aligned(rollouts, [r.logprobs for r in rollouts], length - 1),
            "mask": response_aligned(rollouts, [r.mask for r in rollouts], length - 1)}


def microbatch_tensors(rollouts, advantages: Sequence[float], members: list[int], pad_multiple: int = 1,
                       extra: dict[str, Sequence[Sequence[float]]] | None = None) -> dict[str, torch.Tensor]:
    """The model inputs and loss tensors of one microbatch: `inputs` / `targets` [b, T], the
    engine's `old_logprobs`, `mask`, `advantages` [b], `index` [b] (positions in `rollouts`),
    `sequences` [b] (1: a real sequence), `input_real` [b, T] (True where an input token is a
    sequence's, not padding: the MoE layers route no padding, gspo_mcore.megatron.qwen3_moe.routing). T is padded to a multiple of `pad_multiple` (sequence
    parallelism splits it over the TP ranks; right padding, masked, does not change a causal
    model's outputs before it). `extra`: per-rollout, per-response-token values (e.g.
    `ref_logprobs`), laid out like the log-probs."""
    chosen = [rollouts[i] for i in members]
    batch = collate(chosen)
    tokens = batch.pop("tokens")
    for name, values in (extra or {}).items():
        batch[name] = response_aligned(chosen, [values[i] for i in members], tokens.shape[1] - 1)
    pad = -(tokens.shape[1] - 1) % pad_multiple
    if pad:
        tokens = torch.nn.functional.pad(tokens, (0, pad))
        batch = {k: torch.nn.functional.pad(v, (0, pad)) for k, v in batch.items()}
    width = tokens.shape[1] - 1
    lengths = torch.tensor([len(r.prompt_ids) + len(r.response_ids) for r in chosen])
    batch["input_real"] = torch.arange(width) < lengths[:, None]  # [b, T]: a token is there (not padding)
    return {**batch, "inputs": tokens[:, :-1], "targets": tokens[:, 1:],
            "advantages": torch.tensor([float(advantages[i]) for i in members]),
            "index": torch.tensor(members), "sequences": torch.ones(len(members))}


def input_aligned_routing(rollouts, num_experts: int, width: int,
                          routed_by_older: Sequence[bool] | None = None) -> dict[str, torch.Tensor]:
    """The engine's routed experts as model inputs see them: `routing` [B, width, layers,
    top-k] (row t: input token t), `real_inputs` [B, width] (1 where a real token is) and
    `older_inputs` [B, width] (1 on the real rows of a sequence `routed_by_older` marks: older
    weights than the trainer's routed it). Padding rows name distinct experts 0..k-1 (a
    replayed router needs a valid top-k)."""
    first = rollouts[0].routed_experts
    layers, top_k = first.shape[1:]
    routing = (torch.arange(top_k) % num_experts).expand(len(rollouts), width, layers, top_k).clone()
    real = torch.zeros(len(rollouts), width)
    older = torch.zeros(len(rollouts), width)
    for i, r in enumerate(rollouts):
        n = r.routed_experts.shape[0]
        routing[i, :n] = torch.from_numpy(r.routed_experts.astype("int64"))
        real[i, :n] = 1.0
        if routed_by_older is not None and routed_by_older[i]:
            older[i, :n] = 1.0
    return {"routing": routing, "real_inputs": real, "older_inputs": older}


def filler_microbatch(template: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A microbatch of one padding sequence, fully masked, shaped like `template` with one row:
    it runs a forward and backward (and, under expert parallelism, every all-to-all its peers
    wait in) and contributes nothing to the loss, the gradient or the counts."""
    out = {}
    for key, value in template.items():
        out[key] = torch.zeros_like(value[:1])
    out["index"] = torch.full_like(template["index"][:1], -1)
    if "routing" in template:  # a valid top-k: distinct experts
        out["routing"] = template["routing"][:1].clone()
    return out


def equalize_count(microbatches: list[dict], count: int) -> list[dict]:
    """Append filler microbatches up to `count`: data-parallel ranks must run the same number of
    microbatches, or under expert parallelism one goes on to the gradient reduce while its peers
    wait for it in an all-to-all (a hang)."""
    if len(microbatches) > count:
        raise ValueError(f"{len(microbatches)} microbatches exceed the agreed count {count}")
    return microbatches + [filler_microbatch(microbatches[0]) for _ in range(count - len(microbatches))]
