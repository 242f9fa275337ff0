"""Policy-gradient losses: GSPO (sequence level), GSPO-token, token-level GRPO/PPO, and the
GSPO lineage (SAPO, GMPO, LUSPO, CISPO); the train-inference mismatch correction (TIS / MIS).

Pure tensor functions (no Megatron). Equations cite Zheng et al., "Group Sequence Policy
Optimization", arXiv 2507.18071, unless a function names its own paper. `old_logprobs` is
pi_old: by default the inference engine's token log-probs of the tokens it sampled; a step's first
minibatch takes its own forward, detached (loss.on_policy_first_minibatch); the asynchronous modes
take pi_prox (loss.proximal: a forward of the batch, or the first minibatch's); comparison runs
recompute it (train.recompute_old_logprobs). `LossInputs` says which.

Every level first builds a per-token loss matrix [B, T] (a sequence-level term is spread
over its tokens), then `aggregate` reduces it. Passing the *global* counts of the whole
minibatch (all microbatches, all data-parallel ranks) to `aggregate` makes the sum of the
per-microbatch losses equal the global loss exactly (see gspo_mcore.megatron.pipeline_loss).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from gspo_mcore.common.errors import InputError
from gspo_mcore.common.plugins import by_name

from gspo_mcore.gspo.choices import (AGGREGATIONS, CLIP_FIELDS, KL_ESTIMATORS, LEVELS,  # noqa: F401 (re-exported)
                                     MISMATCH_CORRECTIONS, OWN_FIELDS, Aggregation, KLEstimator, Level,
                                     MismatchCorrection, foreign_fields)

# The paper's at every level: eq. 5 / eq. 13 average per sequence, then over sequences.
DEFAULT_AGGREGATION = "seq-mean-token-mean"
# A built-in whose paper reduces otherwise: CISPO averages over every token of the batch
# (MiniMax-M1 eq. 4); LUSPO's length scaling makes a sequence weigh its token count.
PAPER_AGGREGATION = {"cispo": "token-mean", "luspo": "seq-mean-token-sum"}
LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 5e8: far outside any clip band, finite in float32


@dataclass(frozen=True)
class Normalizer:
    """Denominators of the aggregation. Defaults (None) are the local batch's own counts;
    the trainer passes the global minibatch's."""

    num_sequences: float | None = None
    num_tokens: float | None = None
    horizon: float | None = None  # seq-mean-token-sum-norm: the fixed max response length


def _wide(t: torch.Tensor) -> torch.Tensor:
    """At least float32 (float64 stays float64)."""
    return t if t.dtype == torch.float64 else t.float()


def _check(logprobs, old_logprobs, advantages, mask) -> None:
    if logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape or logprobs.dim() != 2:
        raise ValueError(
            f"logprobs {list(logprobs.shape)}, old_logprobs {list(old_logprobs.shape)} and mask "
            f"{list(mask.shape)} must be the same [B, T]"
        )
    if advantages.shape not in (logprobs.shape[:1], logprobs.shape):
        raise ValueError(f"advantages {list(advantages.shape)} must be [B] or [B, T] for logprobs {list(logprobs.shape)}")
    deferred = _DEFERRED.get()
    checks = deferred if deferred is not None else InputChecks()
    checks.add("old_logprobs", old_logprobs, mask)
    if deferred is None:  # a call on its own (tests, the reference step): checked now
        checks.raise_if_any()


# ---- the inputs' finiteness, checked without a host sync per microbatch
# Reading a flag of a CUDA tensor on the host (bool(), int(), .nonzero()) waits for every kernel
# queued before it: once per microbatch, the host would stop queueing the next forward and the
# GPU would idle through the launch gap. Inside `deferred_input_checks` each call leaves a device
# tensor instead, and the step reads them all at once.

def _first_nonfinite(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The flat index of the first non-finite value of `values` where `mask` is set, -1 where
    none is: a 0-d int64 tensor on values' device, computed without reading anything back
    (torch.argmax returns the first maximal index)."""
    bad = (~torch.isfinite(values) & mask.bool()).reshape(-1)
    if bad.numel() == 0:
        return torch.full((), -1, dtype=torch.int64, device=values.device)
    return torch.where(bad.any(), bad.to(torch.uint8).argmax(), -1)


class InputChecks:
    """Finiteness checks of the losses' inputs, noted per call (`add`) and read together
    (`raise_if_any`: one host sync for all of them)."""

    def __init__(self):
        self.pending: list[tuple[str, torch.Tensor, int, torch.Tensor | None]] = []
        self.rows: torch.Tensor | None = None  # `naming_samples`: row r of the inputs is sample rows[r]

    def add(self, name: str, values: torch.Tensor, mask: torch.Tensor) -> None:
        self.pending.append((name, _first_nonfinite(values, mask), values.shape[-1], self.rows))

    def raise_if_any(self) -> None:
        """ValueError naming the first non-finite value noted (the tensor, its sample and token); clears."""
        pending, self.pending = self.pending, []
        if not pending:
            return
        firsts = torch.stack([first for _, first, _, _ in pending]).tolist()
        for (name, _, width, rows), first in zip(pending, firsts):
            if first >= 0:
                row, token = divmod(first, width)
                sample = int(rows[row]) if rows is not None else row
                raise ValueError(f"{name}: non-finite value in sample {sample} at token {token}")


_DEFERRED: contextvars.ContextVar[InputChecks | None] = contextvars.ContextVar("gspo_loss_checks", default=None)


@contextlib.contextmanager
def deferred_input_checks() -> Iterator[InputChecks]:
    """Within it the built-in losses note their input checks instead of reading them; the caller
    reads them once with `raise_if_any` (gspo_mcore.megatron.optimizer.optimizer_step: after the
    schedule's last microbatch, before the optimizer's step, so a bad input never updates)."""
    checks = InputChecks()
    token = _DEFERRED.set(checks)
    try:
        yield checks
    finally:
        _DEFERRED.reset(token)


@contextlib.contextmanager
def naming_samples(rows: torch.Tensor) -> Iterator[None]:
    """Within it a deferred check names row r of the loss's inputs as sample `rows[r]` (a
    microbatch's positions in the step's batch: gspo_mcore.gspo.packing `index`)."""
    checks = _DEFERRED.get()
    previous = checks.rows if checks is not None else None
    if checks is not None:
        checks.rows = rows
    try:
        yield
    finally:
        if checks is not None:
            checks.rows = previous


def sequence_log_ratio(logprobs, old_logprobs, mask) -> torch.Tensor:
    """log s_i = (1/|y_i|) sum_t (log pi_theta - log pi_old)  (eq. 7), float32; 0 for an empty response."""
    mask = mask.to(_wide(logprobs).dtype)
    length = mask.sum(-1)
    log_ratio = ((_wide(logprobs) - _wide(old_logprobs)) * mask).sum(-1) / length.clamp(min=1)
    return log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _clipped_objective(ratio, advantages, clip_low, clip_high, dual_clip):
    """min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), with an optional lower bound c A for A < 0."""
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    objective = torch.minimum(ratio * advantages, clipped * advantages)
    if dual_clip is not None:
        objective = torch.where(advantages < 0, torch.maximum(objective, dual_clip * advantages), objective)
    return objective


def aggregate(token_loss, mask, aggregation: str, normalizer: Normalizer = Normalizer()) -> torch.Tensor:
    """Reduce a per-token loss matrix [B, T] over response tokens."""
    mask = mask.to(token_loss.dtype)
    masked = token_loss * mask
    lengths = mask.sum(-1)
    num_sequences = normalizer.num_sequences if normalizer.num_sequences is not None else float(mask.shape[0])
    if aggregation == "token-mean":
        num_tokens = normalizer.num_tokens if normalizer.num_tokens is not None else lengths.sum().clamp(min=1)
        return masked.sum() / num_tokens
    if aggregation == "seq-mean-token-sum":
        return masked.sum() / num_sequences
    if aggregation == "seq-mean-token-mean":
        return (masked.sum(-1) / lengths.clamp(min=1)).sum() / num_sequences
    if aggregation == "seq-mean-token-sum-norm":
        horizon = normalizer.horizon if normalizer.horizon is not None else float(mask.shape[1])
        return masked.sum() / (num_sequences * horizon)
    raise ValueError(f"aggregation {aggregation!r} is not one of {AGGREGATIONS}")


def _token_log_ratio(logprobs, old_logprobs) -> torch.Tensor:
    """log r_t = log pi_theta - log pi_old per token, clamped so its exp stays finite."""
    return (_wide(logprobs) - _wide(old_logprobs)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _prepare(logprobs, old_logprobs, advantages, mask, token_mask_band, sequence_mask_threshold):
    """What every built-in starts from: the checks, the float mask with the mismatch masks of
    `mismatch_keep` applied (masked tokens leave the ratio and the loss; the counts stay global),
    per-token advantages [B, T], and the masks' metrics."""
    _check(logprobs, old_logprobs, advantages, mask)
    mask = mask.to(_wide(logprobs).dtype)
    adv = _wide(advantages) if advantages.dim() == 2 else _wide(advantages)[:, None].expand_as(mask)
    keep, mask_metrics = mismatch_keep(logprobs, old_logprobs, adv, mask, token_mask_band, sequence_mask_threshold)
    return (mask if keep is None else mask * keep), adv, mask_metrics


def _reduce(objective, mask, weight, aggregation, normalizer) -> torch.Tensor:
    """The loss to minimise: -J, each token's objective times its mismatch-correction weight
    (`mismatch_weight`; None: 1), aggregated."""
    return -aggregate(objective if weight is None else objective * weight, mask, aggregation, normalizer)


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: str = "sequence",
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    aggregation: str | None = None,
    dual_clip: float | None = None,
    entropy: torch.Tensor | None = None,
    normalizer: Normalizer = Normalizer(),
    token_mask_band: tuple[float, float] | None = None,
    sequence_mask_threshold: float | None = None,
    weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Returns (loss to minimise, metrics). Shapes: logprobs/old_logprobs/mask [B, T];
    advantages [B] (per sequence) or [B, T] (per token; sequence_token and token levels).
    `token_mask_band` / `sequence_mask_threshold`: the mismatch masks of `mismatch_keep`;
    `weight` [B, T]: the mismatch correction's (`mismatch_weight`), None: none."""
    if level not in LEVELS:
        raise ValueError(f"level {level!r} is not one of {LEVELS}")
    if level == "sequence" and advantages.dim() == 2:
        raise ValueError("level 'sequence' takes one advantage per sequence ([B]); use 'sequence_token'")
    mask_f, adv, mask_metrics = _prepare(logprobs, old_logprobs, advantages, mask, token_mask_band,
                                         sequence_mask_threshold)
    seq_ratio = sequence_log_ratio(logprobs, old_logprobs, mask_f).exp()

    if level == "sequence":  # eq. 5-7
        ratio = seq_ratio[:, None].expand_as(mask_f)
    elif level == "sequence_token":  # eq. 13-14: s_it = sg[s_i] * pi_t / sg[pi_t]
        token_logprobs = _wide(logprobs)
        ratio = seq_ratio.detach()[:, None] * (token_logprobs - token_logprobs.detach()).exp()
    else:  # GRPO / PPO token-level ratio
        ratio = _token_log_ratio(logprobs, old_logprobs).exp()

    objective = _clipped_objective(ratio, adv, clip_low, clip_high, dual_clip)
    loss = _reduce(objective, mask_f, weight, aggregation or DEFAULT_AGGREGATION, normalizer)

    with torch.no_grad():
        # Clipped = the min() took the clipped branch, so the token gives no gradient: the share
        # of response tokens, the same quantity at every level (the paper's Figure 2 compares it).
        clipped_high, clipped_low = (adv > 0) & (ratio > 1 + clip_high), (adv < 0) & (ratio < 1 - clip_low)
        metrics = {**_ratio_metrics(logprobs, old_logprobs, mask_f, clip_low, clip_high, entropy),
                   **_clip_metrics(clipped_high, clipped_low, mask_f)}
        if level == "sequence":
            metrics["clip_fraction_sequences"] = _sequence_mean((clipped_high | clipped_low)[:, 0], mask_f, 0.0)
    return loss, {**metrics, **mask_metrics}


@torch.no_grad()
def mismatch_keep(logprobs, engine_logprobs, adv, mask, token_band: tuple[float, float] | None,
                  sequence_threshold: float | None) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """Train-inference mismatch masks that need no recomputation: they compare the current
    forward with the engine's log-probs only. Returns (keep [B, T] or None, metrics).

    - token band (IcePop, Ling team 2025): a token whose pi_theta / pi_engine leaves
      [low, high] gives no gradient;
    - sequence threshold delta (DeepSeek-V3.2's off-policy sequence masking): a sequence with
      negative advantage whose mean log(pi_engine / pi_theta) over its tokens exceeds delta
      gives no gradient (learning from negative samples the policy has already moved far from
      destabilises it; positive ones are kept).
    The metrics (`token_mask_fraction` of response tokens, `sequence_mask_fraction` of
    sequences) say how much each masked."""
    if token_band is None and sequence_threshold is None:
        return None, {}
    log_ratio = (_wide(logprobs).detach() - _wide(engine_logprobs)) * mask  # log pi_theta / pi_engine
    keep = mask.clone()
    metrics = {}
    num_tokens = mask.sum().clamp(min=1)
    has_tokens = (mask.sum(-1) > 0).to(mask.dtype)
    if token_band is not None:
        low, high = token_band
        inside = (log_ratio >= math.log(low)) & (log_ratio <= math.log(high))
        keep = keep * inside
        metrics["token_mask_fraction"] = (mask * ~inside).sum() / num_tokens
    if sequence_threshold is not None:
        mean_log_engine_over_theta = -log_ratio.sum(-1) / mask.sum(-1).clamp(min=1)
        negative = (adv * mask).sum(-1) < 0  # per-sequence advantage (per-token ones: their sum)
        drop = negative & (mean_log_engine_over_theta > sequence_threshold)
        keep = keep * ~drop[:, None]
        metrics["sequence_mask_fraction"] = (drop.to(mask.dtype) * has_tokens).sum() / has_tokens.sum().clamp(min=1)
    return keep, metrics


@torch.no_grad()
def mismatch_weight(old_logprobs, engine_logprobs, mask, correction: str,
                    threshold: float) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """loss.mismatch_correction: importance weights for the train-inference mismatch at theta_old,
    rho = pi_trainer(theta_old) / pi_engine, which multiply each token's objective (no gradient).
    Returns (weight [B, T] or None for `none`, metrics).

    - `token_tis` (truncated IS, Yao et al. 2025; verl's rollout_is, TRL's token_truncate):
      w_t = min(rho_t, C);
    - `sequence_mis` (masked IS; TRL's sequence_mask, verl's sequence rejection): rho_i =
      prod_t rho_t over the response, w_i = rho_i inside [1/C, C], 0 outside.
    rho needs pi_old to be the trainer's: train.recompute_old_logprobs, or a step's first
    minibatch with loss.on_policy_first_minibatch. Where pi_old is the engine's, rho = 1 and
    the loss's own ratio pi_theta / pi_engine carries the mismatch."""
    if correction == "none":
        return None, {}
    if correction not in MISMATCH_CORRECTIONS:
        raise ValueError(f"mismatch correction {correction!r} is not one of {MISMATCH_CORRECTIONS}")
    mask = mask.to(_wide(old_logprobs).dtype)
    log_rho = _token_log_ratio(old_logprobs, engine_logprobs) * mask
    num_tokens = mask.sum().clamp(min=1)
    if correction == "token_tis":
        rho = log_rho.exp()
        weight = rho.clamp(max=threshold)
        metrics = {"mismatch_truncated_fraction": (mask * (rho > threshold)).sum() / num_tokens}
    else:
        log_rho_sequence = log_rho.sum(-1).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        inside = log_rho_sequence.abs() <= math.log(threshold)
        weight = (log_rho_sequence.exp() * inside)[:, None].expand_as(mask)
        has_tokens = (mask.sum(-1) > 0).to(mask.dtype)
        metrics = {"mismatch_masked_fraction": (has_tokens * ~inside).sum() / has_tokens.sum().clamp(min=1)}
    metrics["mismatch_weight_mean"] = (weight * mask).sum() / num_tokens
    return weight, metrics


@torch.no_grad()
def engine_mismatch(logprobs, engine_logprobs, mask, clip_low: float, clip_high: float) -> dict[str, torch.Tensor]:
    """How far the trainer's log-probs are from the engine's on the same tokens: per sequence
    |log s_i| with s_i the length-normalised ratio of eq. 7 (mean and max), per token
    |log pi_trainer - log pi_engine| (before length normalisation), KL(pi_engine || pi_trainer)
    per token (k3 on the engine's samples), and the share of sequences whose s_i is outside the
    clip band. At theta = theta_old (a step's first minibatch) this is the train-inference
    mismatch alone, whatever pi_old the loss uses."""
    mask = mask.to(_wide(logprobs).dtype)
    token = (_wide(logprobs) - _wide(engine_logprobs)) * mask
    seq = sequence_log_ratio(logprobs, engine_logprobs, mask)
    has_tokens = (mask.sum(-1) > 0).to(mask.dtype)
    count = has_tokens.sum().clamp(min=1)
    num_tokens = mask.sum().clamp(min=1)
    out_of_band = (seq.exp() > 1 + clip_high) | (seq.exp() < 1 - clip_low)
    return {
        "mismatch_num_sequences": has_tokens.sum(), "mismatch_num_tokens": mask.sum(),
        "mismatch_abs_log_ratio_mean": (seq.abs() * has_tokens).sum() / count,
        "mismatch_abs_log_ratio_max": (seq.abs() * has_tokens).max(),
        "mismatch_token_abs_log_ratio_mean": token.abs().sum() / num_tokens,
        # kl_penalty(p, q, "k3") estimates KL(p || q) on samples of p: here p is the engine's. In
        # float64: the float32 engine's mismatch (~1e-7 per token) gives a KL of ~1e-14.
        "mismatch_kl": (kl_penalty(engine_logprobs.double(), logprobs.double(), "k3") * mask).sum() / num_tokens,
        "mismatch_out_of_band_fraction": (out_of_band.to(mask.dtype) * has_tokens).sum() / count,
    }


# Masked reductions only: no Python branch on a tensor, so no GPU sync per microbatch. Over the
# sequences with response tokens; with none, ratios read 1 and fractions 0.
def _sequence_mean(values, mask, empty: float):
    weight = (mask.sum(-1) > 0).to(mask.dtype)
    count = weight.sum()
    return torch.where(count > 0, (values.to(weight.dtype) * weight).sum() / count.clamp(min=1),
                       torch.full_like(count, empty))


def _sequence_extreme(values, mask, reduce, fill: float, empty: float):
    has_tokens = mask.sum(-1) > 0
    return torch.where(has_tokens.any(), reduce(torch.where(has_tokens, values, fill)),
                       torch.full((), empty, dtype=mask.dtype, device=mask.device))


def _token_mean(values, mask):
    return (values.to(mask.dtype) * mask).sum() / mask.sum().clamp(min=1)


def _ratio_metrics(logprobs, old_logprobs, mask, clip_low, clip_high, entropy) -> dict[str, torch.Tensor]:
    """The figures every built-in reports: counts, the sequence ratio s_i of eq. 7 against pi_old
    (whatever ratio the loss itself takes), per-token |log r|, the policy entropy."""
    seq_log_ratio = sequence_log_ratio(logprobs.detach(), old_logprobs, mask)
    seq_ratio, abs_log_ratio = seq_log_ratio.exp(), seq_log_ratio.abs()
    token_log_ratio = (_wide(logprobs.detach()) - _wide(old_logprobs)) * mask
    metrics = {
        "num_tokens": mask.sum(), "num_sequences": (mask.sum(-1) > 0).to(mask.dtype).sum(),
        "ratio_mean": _sequence_mean(seq_ratio, mask, 1.0),
        "ratio_min": _sequence_extreme(seq_ratio, mask, torch.min, float("inf"), 1.0),
        "ratio_max": _sequence_extreme(seq_ratio, mask, torch.max, float("-inf"), 1.0),
        "abs_log_ratio_mean": _sequence_mean(abs_log_ratio, mask, 0.0),
        "abs_log_ratio_max": _sequence_extreme(abs_log_ratio, mask, torch.max, 0.0, 0.0),
        # Per token, before length normalisation: eq. 7's average shrinks it by ~sqrt(|y|).
        "abs_log_ratio_token_mean": _token_mean(token_log_ratio.abs(), mask),
        "ratio_above_band": _sequence_mean(seq_ratio > 1 + clip_high, mask, 0.0),
        "ratio_below_band": _sequence_mean(seq_ratio < 1 - clip_low, mask, 0.0),
    }
    if entropy is not None:
        metrics["entropy"] = _token_mean(_wide(entropy.detach()), mask)
    return metrics


def _clip_metrics(clipped_high, clipped_low, mask) -> dict[str, torch.Tensor]:
    """Shares of response tokens a loss's clip took, above and below (each loss says what its
    clip is)."""
    return {"clip_fraction": _token_mean(clipped_high | clipped_low, mask),
            "clip_fraction_high": _token_mean(clipped_high, mask), "clip_fraction_low": _token_mean(clipped_low, mask)}


def kl_penalty(logprobs, ref_logprobs, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from sampled tokens (Schulman's k1/k2/k3).
    Off in the paper's setup; aggregate it like the policy loss, times a coefficient."""
    log_ratio = (_wide(logprobs) - _wide(ref_logprobs)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":  # expm1: exact to the last bit where the ratio is near 1
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"KL estimator {estimator!r} is not one of {KL_ESTIMATORS}")


@dataclass(frozen=True)
class LossInputs:
    """What a policy loss (`loss.function`) gets for one microbatch: tensors [B, T] over its
    sequences and their tokens (response tokens where `mask` is 1), float32 or wider."""

    logprobs: torch.Tensor
    """log pi_theta of each token under the current weights: the gradient flows through these."""
    old_logprobs: torch.Tensor
    """log pi_old: the engine's, recomputed ones (train.recompute_old_logprobs), or on a step's first
    minibatch (loss.on_policy_first_minibatch) `logprobs` detached; asynchronous modes: pi_prox."""
    engine_logprobs: torch.Tensor
    """The engine's own log-probs of the sampled tokens (the behaviour policy); `old_logprobs` unless
    those were recomputed."""
    advantages: torch.Tensor
    """[B] one per sequence, or [B, T] per token; asynchronous modes: times the behaviour weight."""
    mask: torch.Tensor
    """1 on the tokens that train (the response's; an environment's turns in a tool loop are 0)."""
    clip_low: float
    clip_high: float
    """This minibatch's clip band: loss.clip_low / clip_high, after the first minibatch at least
    loss.band_from_mismatch x the measured mismatch."""
    normalizer: Normalizer
    """The whole minibatch's counts (every microbatch, every data-parallel rank): reduce with
    `aggregate(token_loss, mask, aggregation, normalizer)` and the microbatches' losses sum to it."""
    entropy: torch.Tensor | None = None
    """Per-token policy entropy with loss.log_entropy or loss.entropy_coef; None otherwise."""
    weight: torch.Tensor | None = None
    """loss.mismatch_correction's importance weight per token [B, T] (no gradient; a sequence's
    repeated over its tokens), None when off: multiply each token's objective by it before
    `aggregate`, as the built-ins do."""


# (inputs, the config's `loss` section) -> (loss to minimise, metrics: rows of gspo_mcore.metrics.schema).
LossFunction = Callable[[LossInputs, Any], "tuple[torch.Tensor, dict[str, torch.Tensor]]"]


def aggregation_of(cfg) -> str:
    """loss.aggregation, else the paper's of loss.function (PAPER_AGGREGATION; the GSPO paper's
    for the rest): the policy loss, KL and entropy terms all reduce by it."""
    return cfg.aggregation or PAPER_AGGREGATION.get(cfg.function, DEFAULT_AGGREGATION)


def _mask_options(cfg) -> dict:
    return {"token_mask_band": tuple(cfg.token_mask_band) if cfg.token_mask_band else None,
            "sequence_mask_threshold": cfg.sequence_mask_threshold}


def _prepared(inputs: LossInputs, cfg, per_sequence: bool = False):
    """`_prepare` on a built-in's inputs; `per_sequence`: the loss takes one advantage per sequence."""
    if per_sequence and inputs.advantages.dim() == 2:
        raise ValueError(f"loss.function {cfg.function}: takes one advantage per sequence ([B]), got "
                         f"{list(inputs.advantages.shape)}")
    return _prepare(inputs.logprobs, inputs.old_logprobs, inputs.advantages, inputs.mask, **_mask_options(cfg))


def _clipped_loss(inputs: LossInputs, cfg, level: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """policy_loss at `level` with the config's aggregation, dual clip and mismatch masks."""
    return policy_loss(
        inputs.logprobs, inputs.old_logprobs, inputs.advantages, inputs.mask, level=level, clip_low=inputs.clip_low,
        clip_high=inputs.clip_high, aggregation=aggregation_of(cfg), dual_clip=cfg.dual_clip, entropy=inputs.entropy,
        normalizer=inputs.normalizer, weight=inputs.weight, **_mask_options(cfg))


def gspo(inputs: LossInputs, cfg) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO: the sequence ratio s_i of eq. 7, clipped per sequence (eq. 5-6)."""
    return _clipped_loss(inputs, cfg, "sequence")


def gspo_token(inputs: LossInputs, cfg) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO-token (eq. 13-14): s_i's value with each token's gradient, for per-token advantages."""
    return _clipped_loss(inputs, cfg, "sequence_token")


def grpo(inputs: LossInputs, cfg) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO / PPO: a token-level ratio, clipped per token (the comparison runs)."""
    return _clipped_loss(inputs, cfg, "token")


def luspo(inputs: LossInputs, cfg) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """LUSPO (Liu et al., arXiv 2602.05261, Sec. 4.3, its eq. 7): GSPO's clipped sequence term
    (eq. 5-7 above) scaled by its response length |y_i|, averaged over sequences, against GSPO's bias toward short
    responses. Its aggregation is that scaling: seq-mean-token-sum of the term spread over the
    sequence's tokens (PAPER_AGGREGATION; TRL's `luspo`: mean_i(|y_i| l_i)). Equal lengths L: L x GSPO.
    The clip band is GSPO's fields (the paper trained with 2e-3 / 2.5e-3, its Sec. 5.1)."""
    return _clipped_loss(inputs, cfg, "sequence")


def sapo(inputs: LossInputs, cfg) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO (Gao et al., arXiv 2511.20347, eq. 5 the objective, eq. 6 the gate; tau 1.0 / 1.05 its
    Sec. 5.1): J = E[1/G sum_i 1/|y_i| sum_t f_it(r_it) A_it], a soft gate in place of the clip,
    f_it(r) = sigmoid(tau_it (r - 1)) 4 / tau_it, tau_it = loss.sapo_tau_pos where A_it > 0 else
    loss.sapo_tau_neg, r_it the token ratio against pi_old. f'(1) = 1: on-policy its gradient is
    the policy gradient, GSPO's (and GSPO-token's)."""
    mask, adv, metrics = _prepared(inputs, cfg)
    ratio = _token_log_ratio(inputs.logprobs, inputs.old_logprobs).exp()
    tau = torch.full_like(adv, cfg.sapo_tau_neg).masked_fill(adv > 0, cfg.sapo_tau_pos)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    loss = _reduce(gate * adv, mask, inputs.weight, aggregation_of(cfg), inputs.normalizer)
    with torch.no_grad():  # no clip: its fractions are null
        metrics.update(_ratio_metrics(inputs.logprobs, inputs.old_logprobs, mask, inputs.clip_low, inputs.clip_high,
                                      inputs.entropy))
    return loss, metrics


def gmpo(inputs: LossInputs, cfg) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GMPO (Zhao et al., arXiv 2507.20673 v3, eq. 4; its clip (e^-0.4, e^0.4) in Sec. 3 and
    Algorithm 1): the geometric mean of the token ratios, each clipped first, in log space and on the side its
    advantage's sign makes binding (PPO's min):
    J = E[1/G sum_i (prod_t min(r_it^sgn A_i, clip(r_it^sgn A_i, e^-eps, e^eps))^sgn A_i)^(1/|y_i|) A_i],
    eps = loss.gmpo_log_clip (the paper's 0.4). With no token clipped it is GSPO unclipped: the
    geometric mean of the ratios is s_i of eq. 7."""
    mask, adv, metrics = _prepared(inputs, cfg, per_sequence=True)
    log_ratio = _token_log_ratio(inputs.logprobs, inputs.old_logprobs)
    bounded = log_ratio.clamp(-cfg.gmpo_log_clip, cfg.gmpo_log_clip)
    clipped = torch.where(adv > 0, torch.minimum(log_ratio, bounded), torch.maximum(log_ratio, bounded))
    geometric_mean = ((clipped * mask).sum(-1) / mask.sum(-1).clamp(min=1)).exp()
    loss = _reduce(geometric_mean[:, None] * adv, mask, inputs.weight, aggregation_of(cfg), inputs.normalizer)
    with torch.no_grad():  # a token the clip took gives no gradient
        metrics.update(_ratio_metrics(inputs.logprobs, inputs.old_logprobs, mask, inputs.clip_low, inputs.clip_high,
                                      inputs.entropy))
        metrics.update(_clip_metrics((adv > 0) & (log_ratio > cfg.gmpo_log_clip),
                                     (adv < 0) & (log_ratio < -cfg.gmpo_log_clip), mask))
    return loss, metrics


def cispo(inputs: LossInputs, cfg) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, arXiv 2506.13585, eq. 4-5): REINFORCE with the token's importance weight
    clipped and its gradient stopped, so no token's gradient is dropped:
    J = E[1/sum_i |o_i| sum_i sum_t sg(clip(r_it, w_min, w_max)) A_it log pi_theta(o_it)],
    w_max = loss.cispo_weight_max (1 + eps_high^IS; ScaleRL's eps_max = 5), w_min =
    loss.cispo_weight_min (1 - eps_low^IS; None: no lower bound, as MiniMax-M1 trained). Its
    aggregation is the paper's token-mean (PAPER_AGGREGATION). On-policy its gradient is the
    policy gradient, GSPO's under the same aggregation."""
    mask, adv, metrics = _prepared(inputs, cfg)
    ratio = _token_log_ratio(inputs.logprobs, inputs.old_logprobs).exp()
    importance = ratio.clamp(min=cfg.cispo_weight_min, max=cfg.cispo_weight_max).detach()
    loss = _reduce(importance * adv * _wide(inputs.logprobs), mask, inputs.weight, aggregation_of(cfg),
                   inputs.normalizer)
    with torch.no_grad():  # a truncated weight still passes the token's gradient
        metrics.update(_ratio_metrics(inputs.logprobs, inputs.old_logprobs, mask, inputs.clip_low, inputs.clip_high,
                                      inputs.entropy))
        low = ratio < cfg.cispo_weight_min if cfg.cispo_weight_min is not None else torch.zeros_like(ratio, dtype=bool)
        metrics.update(_clip_metrics(ratio > cfg.cispo_weight_max, low, mask))
    return loss, metrics


# The built-ins, by the names gspo_mcore.gspo.choices.BUILT_IN_LOSSES lists (a test holds them equal).
LOSSES: dict[str, LossFunction] = {"gspo": gspo, "gspo_token": gspo_token, "grpo": grpo, "sapo": sapo,
                                   "gmpo": gmpo, "luspo": luspo, "cispo": cispo}
@functools.cache
def load_loss_function(name: str) -> LossFunction:
    """`loss.function`: a built-in (LOSSES) or `module:function`, imported and its signature
    checked once (the run checks it at start-up: gspo_mcore.run.start.check_inputs)."""
    function = by_name(name, LOSSES, "loss.function")
    try:
        inspect.signature(function).bind(None, None)
    except TypeError as err:
        raise InputError(f"loss.function {name!r}: cannot be called as fn(inputs, config) ({err})") from None
    except ValueError:  # no signature to read (a builtin): the first call says
        pass
    return function


def objective(logprobs, batch: dict, cfg, normalizer: Normalizer = Normalizer(), *,
              band: tuple[float, float] | None = None, on_policy: bool = False,
              entropy: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """What an update minimises on a batch of sequences: the policy loss of `cfg.function` (cfg: a
    gspo_mcore.config.LossConfig) with loss.mismatch_correction's weights, + kl_loss_coef x KL to
    `batch["ref_logprobs"]`, - entropy_coef x `entropy`; and the train-inference mismatch against
    the engine's log-probs. The trainer (gspo_mcore.megatron.pipeline_loss) and the tests' Hugging Face
    reference step both call this.

    `batch`: `old_logprobs` (the engine's, or recomputed ones with the engine's in
    `engine_logprobs`), `advantages`, `mask` [B, T]. `band`: (clip_low, clip_high) instead of the
    config's; `on_policy` (theta = theta_old): pi_old is these log-probs, detached."""
    clip_low, clip_high = band or (cfg.clip_low, cfg.clip_high)
    aggregation = aggregation_of(cfg)
    old_logprobs = logprobs.detach() if on_policy else batch["old_logprobs"]
    engine_logprobs = batch.get("engine_logprobs", batch["old_logprobs"])
    advantages, behavior_metrics = batch["advantages"], {}
    if "stale" in batch:  # asynchronous modes: decoupled GSPO
        # Without a recomputed pi_prox (loss.proximal: first_minibatch) a later minibatch's pi_old
        # is the engine's own: weight 1.
        behavior, behavior_metrics = behavior_weight(old_logprobs, engine_logprobs, batch["stale"], batch["mask"],
                                                     cfg.behavior_weight_cap)
        advantages = advantages * (behavior if advantages.dim() == 1 else behavior[:, None])
    weight, correction_metrics = mismatch_weight(old_logprobs, engine_logprobs, batch["mask"], cfg.mismatch_correction,
                                                 cfg.mismatch_threshold)
    inputs = LossInputs(logprobs, old_logprobs, engine_logprobs, advantages, batch["mask"], clip_low, clip_high,
                        normalizer, entropy, weight)
    loss, metrics = load_loss_function(cfg.function)(inputs, cfg)
    metrics = {**metrics, **correction_metrics}
    # Against the engine's log-probs even when pi_old was recomputed: the mismatch in every arm.
    # Asynchronous modes: over the tokens the current weights generated (on older ones the
    # difference is the policy's own change as well), so it stays the train-inference mismatch.
    fresh = batch["mask"] * (1 - batch["stale"]) if "stale" in batch else batch["mask"]
    metrics.update(engine_mismatch(logprobs, engine_logprobs, fresh, cfg.clip_low, cfg.clip_high))
    if cfg.kl_loss_coef > 0:
        kl = aggregate(kl_penalty(logprobs, batch["ref_logprobs"], cfg.kl_estimator), batch["mask"], aggregation,
                       normalizer)
        loss = loss + cfg.kl_loss_coef * kl
        metrics["kl"] = kl.detach()
    if cfg.entropy_coef > 0:  # a bonus: higher entropy lowers the loss
        loss = loss - cfg.entropy_coef * aggregate(entropy, batch["mask"], aggregation, normalizer)
    return loss, {**metrics, **behavior_metrics}


@torch.no_grad()
def behavior_weight(prox_logprobs, engine_logprobs, stale, mask, cap: float) -> tuple[torch.Tensor, dict]:
    """Decoupled GSPO's per-sequence behaviour weight (the sequence-level form of AReaL's
    decoupled PPO): w_i = min(cap, exp((1/|y_i|) sum_t stale_t (log pi_prox - log pi_engine))),
    over the tokens an older weight version generated (`stale` 1), length-normalised like eq. 7.
    pi_prox is the trainer at the start of the step; the clipped ratio is taken against it, so w
    carries the rest of the importance ratio to the engine's behaviour policy. A sequence with no
    stale token weighs exactly 1: with nothing stale the loss is the synchronous one."""
    mask = mask.to(_wide(prox_logprobs).dtype)
    log_ratio = ((_wide(prox_logprobs) - _wide(engine_logprobs)) * mask * stale).sum(-1) / mask.sum(-1).clamp(min=1)
    raw = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    weight = raw.clamp(max=cap)
    has_tokens = (mask.sum(-1) > 0).to(mask.dtype)
    count = has_tokens.sum().clamp(min=1)
    return weight, {"behavior_weight_mean": (weight * has_tokens).sum() / count,
                    "behavior_weight_truncated_fraction": ((raw > cap).to(mask.dtype) * has_tokens).sum() / count}
