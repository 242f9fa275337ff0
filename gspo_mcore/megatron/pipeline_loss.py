"""The policy loss (loss.function: GSPO, its lineage, or yours) inside Megatron's pipeline
schedule, with exact global normalisation.

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
from gspo_mcore.gspo.logprobs import token_logprobs
from gspo_mcore.megatron.parallel import device
from gspo_mcore.gspo.loss import Normalizer, naming_samples, objective


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
    num_sequences, num_tokens = local.tolist()  # one read per optimizer step, before its schedule
    return Normalizer(num_sequences=num_sequences, num_tokens=num_tokens, horizon=float(horizon))


def make_loss_func(microbatch: dict, normalizer: Normalizer, cfg: LossConfig, temperature: float,
                   num_microbatches: int, *, band: tuple[float, float] | None = None, on_policy: bool = False):
    """A `loss_func(logits)` for one microbatch: `gspo_mcore.gspo.loss.objective` on the log-probs of
    `targets` [b, T] under `temperature` (the engine's). `microbatch` also holds what `objective`
    reads (`old_logprobs`, `advantages`, `mask`, and `ref_logprobs` / `engine_logprobs` when
    used). Its metrics are per microbatch, for gspo_mcore.metrics.report.combine; `loss` and `kl` are
    this microbatch's shares of the global minibatch figures (they sum). Nothing in it reads a
    device value on the host (tests/test_loss_sync.py): the loss's input checks are deferred to the
    step (gspo_mcore.gspo.loss.deferred_input_checks), the metrics stay tensors until the step ends."""
    scale = num_microbatches * parallel_state.get_data_parallel_world_size()
    with_entropy = cfg.log_entropy or cfg.entropy_coef > 0

    def loss_func(logits: torch.Tensor):
        logprobs, entropy = token_logprobs(logits, microbatch["targets"], temperature=temperature,
                                           group=parallel_state.get_tensor_model_parallel_group(),
                                           with_entropy=with_entropy)
        with naming_samples(microbatch["index"]):  # a deferred input check's error names the rollout
            loss, metrics = objective(logprobs, microbatch, cfg, normalizer, band=band, on_policy=on_policy,
                                      entropy=entropy)
        # `loss` is this microbatch's share of the global loss; report it unscaled.
        return loss * scale, {"loss": loss.detach().clone(), **metrics}

    return loss_func
