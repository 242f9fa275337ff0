"""The GSPO loss inside Megatron's pipeline schedule, with exact global normalisation.

Megatron's schedule divides each microbatch's loss by the number of microbatches, and DDP
averages gradients over data-parallel ranks. A per-microbatch mean would therefore weight
sequences by the microbatch they landed in. Instead each microbatch's loss is its sum of
per-sequence (or per-token) terms divided by the *global* count of the minibatch (computed
before the step, all-reduced over DP), and multiplied by num_microbatches x DP size to undo
the two averagings: the gradient is exactly that of the global minibatch loss.
Sequence-level terms need only per-sequence sums, so no token tensor crosses ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from gspo_mcore.config import LossConfig
from gspo_mcore.logprobs import token_logprobs
from gspo_mcore.parallel import device
from gspo_mcore.loss import Normalizer, aggregate, engine_mismatch, kl_penalty, policy_loss


def global_normalizer(microbatches: list[dict], horizon: float) -> Normalizer:
    """Sequence and token counts of the whole minibatch: this rank's microbatches (their real
    `sequences`; filler microbatches count none), summed over data-parallel ranks, and the
    constant `horizon` of seq-mean-token-sum-norm. Collective over the DP group."""
    local = torch.tensor(
        [sum(float(mb["sequences"].sum()) for mb in microbatches), sum(float(mb["mask"].sum()) for mb in microbatches)],
        dtype=torch.float64, device=device(),
    )
    group = parallel_state.get_data_parallel_group()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(local, group=group)
    return Normalizer(num_sequences=local[0].item(), num_tokens=local[1].item(), horizon=float(horizon))


def make_loss_func(microbatch: dict, normalizer: Normalizer, cfg: LossConfig, num_microbatches: int, *,
                   band: tuple[float, float] | None = None, on_policy: bool = False):
    """A `loss_func(logits)` for one microbatch. `microbatch` holds `targets` [b, T] (the
    next tokens), `old_logprobs` [b, T] (the engine's), `advantages` [b] or [b, T], `mask`
    [b, T], `ref_logprobs` [b, T] when a KL penalty is on, and `engine_logprobs` [b, T] when
    `old_logprobs` were recomputed. Its metrics are per microbatch,
    for gspo_mcore.metrics.combine; `loss` and `kl` are this microbatch's shares of the global
    minibatch figures (they sum). `band`: (clip_low, clip_high) instead of the config's;
    `on_policy` (theta = theta_old): pi_old is this forward's own log-probs, detached."""
    scale = num_microbatches * parallel_state.get_data_parallel_world_size()
    clip_low, clip_high = band or (cfg.clip_low, cfg.clip_high)
    aggregation = cfg.aggregation or "seq-mean-token-mean"
    with_entropy = cfg.log_entropy or cfg.entropy_coef > 0

    def loss_func(logits: torch.Tensor):
        logprobs, entropy = token_logprobs(
            logits,
            microbatch["targets"],
            temperature=cfg.temperature,
            group=parallel_state.get_tensor_model_parallel_group(),
            with_entropy=with_entropy,
        )
        old_logprobs = logprobs.detach() if on_policy else microbatch["old_logprobs"]
        loss, metrics = policy_loss(
            logprobs, old_logprobs, microbatch["advantages"], microbatch["mask"],
            level=cfg.level, clip_low=clip_low, clip_high=clip_high, aggregation=cfg.aggregation,
            dual_clip=cfg.dual_clip, entropy=entropy, normalizer=normalizer,
            token_mask_band=tuple(cfg.token_mask_band) if cfg.token_mask_band else None,
            sequence_mask_threshold=cfg.sequence_mask_threshold,
        )
        # Against the engine's log-probs even when pi_old was recomputed: the mismatch in every arm.
        metrics.update(engine_mismatch(logprobs, microbatch.get("engine_logprobs", microbatch["old_logprobs"]),
                                       microbatch["mask"], cfg.clip_low, cfg.clip_high))
        metrics["clip_band_high"] = torch.full((), clip_high, dtype=torch.float64)
        if cfg.kl_loss_coef > 0:
            kl = aggregate(kl_penalty(logprobs, microbatch["ref_logprobs"], cfg.kl_estimator), microbatch["mask"],
                           aggregation, normalizer)
            loss = loss + cfg.kl_loss_coef * kl
            metrics["kl"] = kl.detach()
        if cfg.entropy_coef > 0:  # a bonus: higher entropy lowers the loss
            loss = loss - cfg.entropy_coef * aggregate(entropy, microbatch["mask"], aggregation, normalizer)
        # `loss` is this microbatch's share of the global loss; report it unscaled.
        return loss * scale, {"loss": loss.detach().clone(), **metrics}

    return loss_func
