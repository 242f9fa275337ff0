"""Policy-gradient losses: GSPO (sequence level), GSPO-token, and token-level GRPO/PPO.

Pure tensor functions (no Megatron). Equations cite Zheng et al., "Group Sequence Policy
Optimization", arXiv 2507.18071. `old_logprobs` are the behaviour policy's token log-probs
as returned by the inference engine: no recomputation by the trainer.

Every level first builds a per-token loss matrix [B, T] (a sequence-level term is spread
over its tokens), then `aggregate` reduces it. Passing the *global* counts of the whole
minibatch (all microbatches, all data-parallel ranks) to `aggregate` makes the sum of the
per-microbatch losses equal the global loss exactly (see gspo_mcore.megatron_loss).
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable, Literal, get_args

import torch

from gspo_mcore.errors import InputError
from gspo_mcore.plugins import by_name

# The choices, as types the config's fields use (gspo_mcore.config) and as tuples for checks.
Level = Literal["sequence", "sequence_token", "token"]
Aggregation = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLEstimator = Literal["k1", "k2", "k3"]
LEVELS, AGGREGATIONS, KL_ESTIMATORS = get_args(Level), get_args(Aggregation), get_args(KLEstimator)
# The paper's at every level: eq. 5 / eq. 13 average per sequence, then over sequences.
DEFAULT_AGGREGATION = "seq-mean-token-mean"
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
    bad = ~torch.isfinite(old_logprobs) & mask.bool()
    if bad.any():
        sample, token = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"old_logprobs: non-finite value in sample {sample} at token {token}")


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
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Returns (loss to minimise, metrics). Shapes: logprobs/old_logprobs/mask [B, T];
    advantages [B] (per sequence) or [B, T] (per token; sequence_token and token levels).
    `token_mask_band` / `sequence_mask_threshold`: the mismatch masks of `mismatch_keep`."""
    if level not in LEVELS:
        raise ValueError(f"level {level!r} is not one of {LEVELS}")
    _check(logprobs, old_logprobs, advantages, mask)
    if level == "sequence" and advantages.dim() == 2:
        raise ValueError("level 'sequence' takes one advantage per sequence ([B]); use 'sequence_token'")
    aggregation = aggregation or DEFAULT_AGGREGATION
    mask_f = mask.to(_wide(logprobs).dtype)
    adv = _wide(advantages) if advantages.dim() == 2 else _wide(advantages)[:, None].expand_as(mask_f)
    keep, mask_metrics = mismatch_keep(logprobs, old_logprobs, adv, mask_f, token_mask_band, sequence_mask_threshold)
    if keep is not None:  # masked tokens leave the ratio and the loss; the counts stay global
        mask, mask_f = mask_f * keep, mask_f * keep
    seq_log_ratio = sequence_log_ratio(logprobs, old_logprobs, mask)
    seq_ratio = seq_log_ratio.exp()

    if level == "sequence":  # eq. 5-7
        ratio = seq_ratio[:, None].expand_as(mask_f)
    elif level == "sequence_token":  # eq. 13-14: s_it = sg[s_i] * pi_t / sg[pi_t]
        token_logprobs = _wide(logprobs)
        ratio = seq_ratio.detach()[:, None] * (token_logprobs - token_logprobs.detach()).exp()
    else:  # GRPO / PPO token-level ratio
        ratio = (_wide(logprobs) - _wide(old_logprobs)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()

    objective = _clipped_objective(ratio, adv, clip_low, clip_high, dual_clip)
    loss = -aggregate(objective, mask_f, aggregation, normalizer)

    with torch.no_grad():
        token_log_ratio = (_wide(logprobs) - _wide(old_logprobs)) * mask_f
        metrics = _metrics(ratio, seq_ratio, seq_log_ratio, token_log_ratio, adv, mask_f, clip_low, clip_high, level,
                           entropy)
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
def engine_mismatch(logprobs, engine_logprobs, mask, clip_low: float, clip_high: float) -> dict[str, torch.Tensor]:
    """How far the trainer's log-probs are from the engine's on the same tokens: per sequence
    |log s_i| with s_i the length-normalised ratio of eq. 7 (mean and max), per token
    |log pi_trainer - log pi_engine| (before length normalisation), and the share of sequences
    whose s_i is outside the clip band. At theta = theta_old (a step's first minibatch) this is
    the train-inference mismatch alone, whatever pi_old the loss uses."""
    mask = mask.to(_wide(logprobs).dtype)
    token = (_wide(logprobs) - _wide(engine_logprobs)) * mask
    seq = sequence_log_ratio(logprobs, engine_logprobs, mask)
    has_tokens = (mask.sum(-1) > 0).to(mask.dtype)
    count = has_tokens.sum().clamp(min=1)
    out_of_band = (seq.exp() > 1 + clip_high) | (seq.exp() < 1 - clip_low)
    return {
        "mismatch_num_sequences": has_tokens.sum(), "mismatch_num_tokens": mask.sum(),
        "mismatch_abs_log_ratio_mean": (seq.abs() * has_tokens).sum() / count,
        "mismatch_abs_log_ratio_max": (seq.abs() * has_tokens).max(),
        "mismatch_token_abs_log_ratio_mean": token.abs().sum() / mask.sum().clamp(min=1),
        "mismatch_out_of_band_fraction": (out_of_band.to(mask.dtype) * has_tokens).sum() / count,
    }


def _metrics(ratio, seq_ratio, seq_log_ratio, token_log_ratio, adv, mask, clip_low, clip_high, level, entropy):
    # Masked reductions only: no Python branch on a tensor, so no GPU sync per microbatch.
    # Over the sequences with response tokens; with none, ratios read 1 and fractions 0.
    has_tokens = mask.sum(-1) > 0
    weight = has_tokens.to(seq_ratio.dtype)
    count = weight.sum()

    def seq_mean(values, empty: float):
        return torch.where(count > 0, (values.to(weight.dtype) * weight).sum() / count.clamp(min=1),
                           torch.full_like(count, empty))

    def seq_extreme(values, reduce, fill: float, empty: float):
        return torch.where(count > 0, reduce(torch.where(has_tokens, values, fill)), torch.full_like(count, empty))

    tokens = mask.bool()
    num_tokens = tokens.sum().to(weight.dtype)

    def token_mean(values):
        return (values.to(weight.dtype) * mask).sum() / num_tokens.clamp(min=1)

    # Clipped = the min() took the clipped branch, so the token gives no gradient: the share of
    # response tokens, the same quantity at every level (the paper's Figure 2 compares it).
    clipped_high = (adv > 0) & (ratio > 1 + clip_high)
    clipped_low = (adv < 0) & (ratio < 1 - clip_low)
    abs_log_ratio = seq_log_ratio.abs()
    metrics = {
        "num_tokens": num_tokens, "num_sequences": count,
        "clip_fraction": token_mean(clipped_high | clipped_low),
        "clip_fraction_high": token_mean(clipped_high),
        "clip_fraction_low": token_mean(clipped_low),
        "ratio_mean": seq_mean(seq_ratio, 1.0),
        "ratio_min": seq_extreme(seq_ratio, torch.min, float("inf"), 1.0),
        "ratio_max": seq_extreme(seq_ratio, torch.max, float("-inf"), 1.0),
        "abs_log_ratio_mean": seq_mean(abs_log_ratio, 0.0),
        "abs_log_ratio_max": seq_extreme(abs_log_ratio, torch.max, 0.0, 0.0),
        # Per token, before length normalisation: eq. 7's average shrinks it by ~sqrt(|y|).
        "abs_log_ratio_token_mean": token_mean(token_log_ratio.abs()),
        "ratio_above_band": seq_mean(seq_ratio > 1 + clip_high, 0.0),
        "ratio_below_band": seq_mean(seq_ratio < 1 - clip_low, 0.0),
    }
    if level == "sequence":
        metrics["clip_fraction_sequences"] = seq_mean((clipped_high | clipped_low)[:, 0], 0.0)
    if entropy is not None:
        metrics["entropy"] = token_mean(_wide(entropy.detach()))
    return metrics


def kl_penalty(logprobs, ref_logprobs, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from sampled tokens (Schulman's k1/k2/k3).
    Off in the paper's setup; aggregate it like the policy loss, times a coefficient."""
    log_ratio = (_wide(logprobs) - _wide(ref_logprobs)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        return (-log_ratio).exp() + log_ratio - 1.0
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


# (inputs, the config's `loss` section) -> (loss to minimise, metrics: rows of gspo_mcore.metric_schema).
LossFunction = Callable[[LossInputs, Any], "tuple[torch.Tensor, dict[str, torch.Tensor]]"]


def _clipped_loss(inputs: LossInputs, cfg, level: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """policy_loss at `level` with the config's aggregation, dual clip and mismatch masks."""
    return policy_loss(
        inputs.logprobs, inputs.old_logprobs, inputs.advantages, inputs.mask, level=level, clip_low=inputs.clip_low,
        clip_high=inputs.clip_high, aggregation=cfg.aggregation or DEFAULT_AGGREGATION, dual_clip=cfg.dual_clip,
        entropy=inputs.entropy, normalizer=inputs.normalizer,
        token_mask_band=tuple(cfg.token_mask_band) if cfg.token_mask_band else None,
        sequence_mask_threshold=cfg.sequence_mask_threshold)


def gspo(inputs: LossInputs, cfg) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO: the sequence ratio s_i of eq. 7, clipped per sequence (eq. 5-6)."""
    return _clipped_loss(inputs, cfg, "sequence")


def gspo_token(inputs: LossInputs, cfg) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO-token (eq. 13-14): s_i's value with each token's gradient, for per-token advantages."""
    return _clipped_loss(inputs, cfg, "sequence_token")


def grpo(inputs: LossInputs, cfg) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO / PPO: a token-level ratio, clipped per token (the comparison runs)."""
    return _clipped_loss(inputs, cfg, "token")


LOSSES: dict[str, LossFunction] = {"gspo": gspo, "gspo_token": gspo_token, "grpo": grpo}


@functools.cache
def load_loss_function(name: str) -> LossFunction:
    """`loss.function`: a built-in (LOSSES) or `module:function`, imported and its signature
    checked once (the run checks it at start-up: gspo_mcore.train.check_inputs)."""
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
    gspo_mcore.config.LossConfig), + kl_loss_coef x KL to `batch["ref_logprobs"]`, - entropy_coef x
    `entropy`; and the train-inference mismatch against the engine's log-probs. The trainer
    (gspo_mcore.megatron_loss) and the tests' Hugging Face reference step both call this.

    `batch`: `old_logprobs` (the engine's, or recomputed ones with the engine's in
    `engine_logprobs`), `advantages`, `mask` [B, T]. `band`: (clip_low, clip_high) instead of the
    config's; `on_policy` (theta = theta_old): pi_old is these log-probs, detached."""
    clip_low, clip_high = band or (cfg.clip_low, cfg.clip_high)
    aggregation = cfg.aggregation or DEFAULT_AGGREGATION
    old_logprobs = logprobs.detach() if on_policy else batch["old_logprobs"]
    engine_logprobs = batch.get("engine_logprobs", batch["old_logprobs"])
    advantages, weight_metrics = batch["advantages"], {}
    if "stale" in batch:  # asynchronous modes: decoupled GSPO
        # Without a recomputed pi_prox (loss.proximal: first_minibatch) a later minibatch's pi_old
        # is the engine's own: weight 1.
        weight, weight_metrics = behavior_weight(old_logprobs, engine_logprobs, batch["stale"], batch["mask"],
                                                 cfg.behavior_weight_cap)
        advantages = advantages * (weight if advantages.dim() == 1 else weight[:, None])
    inputs = LossInputs(logprobs, old_logprobs, engine_logprobs, advantages, batch["mask"], clip_low, clip_high,
                        normalizer, entropy)
    loss, metrics = load_loss_function(cfg.function)(inputs, cfg)
    metrics = dict(metrics)
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
    return loss, {**metrics, **weight_metrics}


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
