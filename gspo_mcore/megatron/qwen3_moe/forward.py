"""Forward passes through Megatron's pipeline schedule: the one place that calls it.

The trainer (updates, recomputed and reference log-probs), the weight-sync check and the
parity CLI all run the model through `run_schedule`, so what the tests prove of one is true
of the others. With `fused_logprobs` (model.fused_logprobs) the last stage hands its loss
function the output layer's input and weight (`linear_logits`) instead of the logits, and the
log-probs are taken without the [tokens, vocabulary] logits (gspo_mcore.gspo.logprobs.LinearLogits).
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import (copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region,
                                           gather_from_tensor_model_parallel_region)
from megatron.core.utils import unwrap_model

from gspo_mcore.config import ConfigError
from gspo_mcore.gspo.logprobs import LinearLogits, token_logprobs
from gspo_mcore.gspo.packing import microbatch_tensors
from gspo_mcore.megatron.parallel import to_device
from gspo_mcore.batch.rollout import Rollout


def position_ids_for(tokens: torch.Tensor) -> torch.Tensor:
    return torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)


@contextlib.contextmanager
def _without_output_layer(gpt):
    """`gpt`'s forward returns the decoder's output (after the final norm: the output layer's
    input, [s, b, h], sequence-sharded under sequence parallelism) on its last stage too:
    megatron-core 0.16.1 GPTModel._postprocess returns `hidden_states` before the output layer
    when `post_process` is False, as on every earlier pipeline stage. The decoder keeps its own
    `post_process` (its final norm), read when it was built."""
    gpt.post_process = False
    try:
        yield
    finally:
        gpt.post_process = True


def linear_logits(gpt, hidden: torch.Tensor) -> LinearLogits:
    """The logits [b, s, V_local] of the decoder's output `hidden` [s(/TP), b, h] as their two
    factors, with the input mapping of the output layer (megatron-core 0.16.1
    tensor_parallel/layers.py ColumnParallelLinear.forward and
    LinearWithGradAccumulationAndAsyncCommunication): under sequence parallelism the sequence
    gathered over the TP group (its backward a reduce-scatter of the gradient), else a copy
    whose backward all-reduces the gradient over the TP group (each rank's is its vocabulary
    slice's share). The weight is the output layer's, or the embedding's when they are tied
    (GPTModel._postprocess's `output_weight`)."""
    layer = gpt.output_layer
    if layer.gradient_accumulation_fusion:  # that backward writes weight.main_grad itself
        raise ConfigError("model.fused_logprobs needs gradient_accumulation_fusion off "
                          "(gspo_mcore/megatron/qwen3_moe/model.py _fusions)")
    weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else layer.weight
    if layer.sequence_parallel:
        hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True, group=layer.tp_group)
    else:
        hidden = copy_to_tensor_model_parallel_region(hidden, group=layer.tp_group)
    return LinearLogits(hidden.transpose(0, 1), weight)


def model_output(model, tokens: torch.Tensor, fused_logprobs: bool = False, input_real: torch.Tensor | None = None):
    """`model`'s output for `tokens` [b, T] (on its device): the logits [b, T, V_local] on the
    last pipeline stage (hidden states elsewhere), or with `fused_logprobs` their `LinearLogits`.
    `input_real` [b, T] (packing.microbatch_tensors): the padding, which the MoE layers route
    nowhere (GPTModel's `padding_mask`, True at padding: routing.drop_padding_routes)."""
    gpt = unwrap_model(model)
    kwargs = {"padding_mask": padding_mask_for(gpt, input_real)} if input_real is not None else {}
    if not (fused_logprobs and gpt.post_process):
        return model(tokens, position_ids_for(tokens), None, **kwargs)
    if getattr(gpt, "mtp_process", False):
        raise ConfigError("model.fused_logprobs: the model has multi-token prediction layers, whose loss "
                          "GPTModel computes from the logits")
    with _without_output_layer(gpt):
        hidden = model(tokens, position_ids_for(tokens), None, **kwargs)
    return linear_logits(gpt, hidden)


def padding_mask_for(gpt, input_real: torch.Tensor) -> torch.Tensor:
    """GPTModel.forward's `padding_mask` [b, T] (True at padding). megatron-core 0.16.1 splits it
    over the sequence-parallel ranks only where the embedding runs (gpt_model.py `_preprocess`,
    the first pipeline stage); a later stage's layers hold this TP rank's contiguous slice of T
    (scatter_to_sequence_parallel_region's), so that slice is what they are given."""
    padding = ~input_real.bool()
    if not gpt.pre_process and gpt.config.sequence_parallel:
        tp = parallel_state.get_tensor_model_parallel_world_size()
        padding = padding.chunk(tp, dim=1)[parallel_state.get_tensor_model_parallel_rank()].contiguous()
    return padding


def run_schedule(model, microbatches: list[dict], loss_for: Callable[[dict], Callable], *,
                 forward_only: bool, routing=None, compare_routing: bool = False,
                 fused_logprobs: bool = False) -> list[dict]:
    """Each microbatch (`inputs` [b, T] and whatever its loss needs) through the pipeline
    schedule; `loss_for(microbatch)` gives the `loss_func(output)` of the last stage, `output`
    the logits or, with `fused_logprobs`, their `LinearLogits` (`model_output`; either goes to
    gspo_mcore.gspo.logprobs.token_logprobs). Returns the loss functions' metric dicts on the last
    pipeline stage ([] elsewhere). `routing`: the model's RouterHooks, told of each microbatch
    before and after its forward (and, with `compare_routing`, to compare the routers' choice
    with the engine's)."""
    data = iter(microbatches)

    def forward_step(data_iterator, model):
        mb = to_device(next(data_iterator))
        if routing is not None:
            routing.before_forward(mb, compare=compare_routing)
        output = model_output(model, mb["inputs"], fused_logprobs, mb.get("input_real"))
        if routing is not None:
            routing.after_forward()
        return output, loss_for(mb)

    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=data, model=[model], num_microbatches=len(microbatches),
        seq_length=max(mb["inputs"].shape[1] for mb in microbatches),
        micro_batch_size=max(mb["inputs"].shape[0] for mb in microbatches), forward_only=forward_only,
    )


@torch.no_grad()
def megatron_logits(model, tokens: torch.Tensor, micro_batch_size: int = 1) -> torch.Tensor | None:
    """Full-vocabulary logits [B, T, V] (on device()), forward only. For parity checks on small
    models: at Qwen3's vocabulary this is GBs; training paths use `token_logprobs`. Returns
    them on the last pipeline stage, None elsewhere."""

    def collect(mb):
        def loss_func(output_tensor):
            return output_tensor.new_zeros(()), {"logits": gather_from_tensor_model_parallel_region(output_tensor)}
        return loss_func

    microbatches = [{"inputs": t} for t in tokens.split(micro_batch_size)]
    outputs = run_schedule(model, microbatches, collect, forward_only=True)
    if not parallel_state.is_pipeline_last_stage():
        return None
    return torch.cat([out["logits"] for out in outputs])


@torch.no_grad()
def response_logprobs(model, microbatches: list[dict], temperature: float, routing=None,
                      fused_logprobs: bool = False) -> dict[int, list[float]]:
    """Forward only: `model`'s log-prob of each response token (where `mask` is 1) of each real
    sequence of `microbatches` (gspo_mcore.gspo.packing.microbatch_tensors), keyed by its `index`;
    the vocabulary never gathered (chunked, vocabulary-parallel log-softmax; with
    `fused_logprobs` the logits never whole either). On the last pipeline stage; {} elsewhere.
    Collective over the model-parallel ranks."""
    was_training = model.training
    model.eval()

    def collect(mb):
        def loss_func(logits):  # or their LinearLogits
            logprobs, _ = token_logprobs(logits, mb["targets"], temperature=temperature,
                                         group=parallel_state.get_tensor_model_parallel_group())
            return logprobs.new_zeros(()), {"index": mb["index"], "logprobs": logprobs.float(), "mask": mb["mask"]}
        return loss_func

    outputs = run_schedule(model, microbatches, collect, forward_only=True, routing=routing,
                           fused_logprobs=fused_logprobs)
    if routing is not None:
        routing.end_step()
    model.train(was_training)
    found = {}
    for out in outputs:
        logprobs, mask = out["logprobs"].cpu(), out["mask"].cpu().bool()  # one copy, not one per row
        found.update((i, logprobs[row][mask[row]].tolist()) for row, i in enumerate(out["index"].tolist()) if i >= 0)
    return found


def sequence_logprobs(model, sequences: list[list[int]], temperature: float = 1.0,
                      fused_logprobs: bool = False) -> list[list[float]] | None:
    """log p(token t | tokens < t) for t >= 1 of each sequence (one forward per sequence). On
    the last pipeline stage; None elsewhere. Collective over the model-parallel ranks."""
    as_rollouts = [Rollout(seq[:1], seq[1:], [0.0] * (len(seq) - 1), "stop", "") for seq in sequences]
    tp = parallel_state.get_tensor_model_parallel_world_size()
    microbatches = [microbatch_tensors(as_rollouts, [0.0] * len(sequences), [i], tp) for i in range(len(sequences))]
    found = response_logprobs(model, microbatches, temperature, fused_logprobs=fused_logprobs)
    return [found[i] for i in range(len(sequences))] if parallel_state.is_pipeline_last_stage() else None


def last_stage_rank() -> int:
    """A global rank on the last pipeline stage (Megatron's rank order puts the last rank there)."""
    return dist.get_world_size() - 1


