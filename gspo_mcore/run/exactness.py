"""Strict exactness (`train.strict_exactness`): a step whose engine log-probs are not the trainer's
at theta_old stops the run, and leaves its evidence.

GSPO here takes the engine's per-token log-probs as pi_old. Where both sides compute in float32 the
two agree to ~1e-6 per sequence (|log s_i| of eq. 7, length-normalised); a larger gap on the tokens
the current weights generated means the engine did not compute what the trainer computes (stale
KV, a token stamped with the wrong weight version, a response matched to another request, a
routing that differs): a slip a bf16 run would hide under its own noise. Before the update the
trainer forwards the whole batch at theta_old; every sequence past the tolerance is written, with
everything needed to replay it, to OUTPUT_DIR/logs/exactness_step_N.json, and the run stops.

Pure functions of Python lists: every rank holds the same batch and the same trainer log-probs
(Learner.token_logprobs_of), so every rank reaches the same verdict without a collective.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from gspo_mcore.common.errors import EngineError
from gspo_mcore.common.files import atomic_output
from gspo_mcore.batch.rollout import Rollout


class ExactnessError(EngineError):
    """The engine's log-probs differ from the trainer's at theta_old beyond the strict tolerance."""


@dataclass(frozen=True)
class Mismatch:
    index: int  # in the batch
    abs_log_ratio: float  # |log s_i| over the sequence's fresh tokens
    worst_token: int  # the response position of the largest |log pi_trainer - log pi_engine| there
    worst_token_gap: float


def fresh_mask(rollout: Rollout, stale: list[float] | None) -> list[float]:
    """The tokens the figure is taken over: the model's (loss mask 1) that the weights being
    updated generated (stale 0); on older versions' tokens the gap is the policy's change too."""
    mask = rollout.mask
    return mask if stale is None else [m * (1.0 - s) for m, s in zip(mask, stale)]


def sequence_mismatch(engine: list[float], trainer: list[float], mask: list[float]) -> float:
    """|log s_i| = |(1/|y|) sum_t mask_t (log pi_trainer - log pi_engine)| (eq. 7), 0 with no token;
    in float64 on the host (the check must not add error of its own)."""
    count = sum(mask)
    if count == 0:
        return 0.0
    return abs(math.fsum(m * (t - e) for e, t, m in zip(engine, trainer, mask)) / count)


def mismatches(rollouts: list[Rollout], trainer_logprobs: list[list[float]], stale: list[list[float]] | None,
               tolerance: float) -> tuple[float, list[Mismatch]]:
    """The batch's largest mismatch, and the sequences past `tolerance` (NaN is past every tolerance)."""
    largest, found = 0.0, []
    for i, (rollout, trainer) in enumerate(zip(rollouts, trainer_logprobs)):
        mask = fresh_mask(rollout, stale[i] if stale is not None else None)
        value = sequence_mismatch(rollout.logprobs, trainer, mask)
        largest = largest if math.isnan(largest) else value if math.isnan(value) else max(largest, value)
        if not value <= tolerance:
            gaps = [abs(t - e) * m for e, t, m in zip(rollout.logprobs, trainer, mask)]
            worst = max(range(len(gaps)), key=lambda t: math.inf if math.isnan(gaps[t]) else gaps[t])
            found.append(Mismatch(i, value, worst, gaps[worst]))
    return largest, found


def evidence(rollouts: list[Rollout], trainer_logprobs: list[list[float]], stale: list[list[float]] | None,
             found: list[Mismatch], step: int, version: str, tolerance: float) -> dict:
    """What a person needs to replay each offending sequence: its tokens, loss mask, per-token
    versions and stale marks, both sides' log-probs, and the requests (server, engine id) it came from."""
    sequences = []
    for m in found:
        r = rollouts[m.index]
        sequences.append({
            "index": m.index, "abs_log_ratio": m.abs_log_ratio, "worst_token": m.worst_token,
            "worst_token_gap": m.worst_token_gap, "requests": list(r.origin),
            "finish_reason": r.finish_reason, "weight_version": r.weight_version,
            "prompt_ids": r.prompt_ids, "response_ids": r.response_ids, "loss_mask": r.mask,
            "token_versions": list(r.token_versions),
            "stale": stale[m.index] if stale is not None else None,
            "engine_logprobs": r.logprobs, "trainer_logprobs": trainer_logprobs[m.index],
            # rollout.return_routed_experts: the engine's top-k per input token and MoE layer (this
            # rank's layers), to tell a routing near-tie flipped by rounding from a wrong computation.
            "engine_routed_experts": r.routed_experts.tolist() if r.routed_experts is not None else None,
        })
    return {"step": step, "trained_version": version, "tolerance": tolerance, "batch_size": len(rollouts),
            "sequences": sequences}


def check(rollouts: list[Rollout], trainer_logprobs: list[list[float]], stale: list[list[float]] | None, *,
          step: int, version: str, tolerance: float, log_dir: Path, write: bool = True) -> float:
    """The batch's largest mismatch; past `tolerance`, the evidence is written to `log_dir` (by the
    rank that `write`s) and ExactnessError names the step, the worst sequence and the file."""
    largest, found = mismatches(rollouts, trainer_logprobs, stale, tolerance)
    if not found:
        return largest
    path = Path(log_dir) / f"exactness_step_{step + 1:06d}.json"
    if write:
        with atomic_output(path) as tmp:
            tmp.write_text(json.dumps(evidence(rollouts, trainer_logprobs, stale, found, step + 1, version,
                                               tolerance)))
    worst = max(found, key=lambda m: math.inf if math.isnan(m.abs_log_ratio) else m.abs_log_ratio)
    origin = ", ".join(rollouts[worst.index].origin) or "request unknown"
    raise ExactnessError(
        f"strict exactness (train.strict_exactness): step {step + 1}: {len(found)} of {len(rollouts)} sequences' "
        f"engine log-probs differ from the trainer's at theta_old by more than {tolerance:g} (worst |log s| "
        f"{worst.abs_log_ratio:.3g}, token {worst.worst_token} off by {worst.worst_token_gap:.3g}, from {origin}); "
        f"evidence in {path}")
