"""Forward passes through Megatron's pipeline schedule: the one place that calls it.

The trainer (updates, recomputed and reference log-probs), the weight-sync check and the
parity CLI all run the model through `run_schedule`, so what the tests prove of one is true
of the others.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from gspo_mcore.parallel import to_device


def position_ids_for(tokens: torch.Tensor) -> torch.Tensor:
    return torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)


def run_schedule(model, microbatches: list[dict], loss_for: Callable[[dict], Callable], *,
                 forward_only: bool, routing=None) -> list[dict]:
    """Each microbatch (`inputs` [b, T] and whatever its loss needs) through the pipeline
    schedule; `loss_for(microbatch)` gives the `loss_func(output)` of the last stage. Returns the
    loss functions' metric dicts on the last pipeline stage ([] elsewhere). `routing`: an
    EngineRouting told of each microbatch before and after its forward."""
    data = iter(microbatches)

    def forward_step(data_iterator, model):
        mb = to_device(next(data_iterator))
        if routing is not None:
            routing.before_forward(mb)
        output = model(mb["inputs"], position_ids_for(mb["inputs"]), None)
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
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

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
def sequence_logprobs(model, sequences: list[list[int]], temperature: float = 1.0) -> list[list[float]] | None:
    """log p(token t | tokens < t) for t >= 1 of each sequence (one forward per sequence, the
    vocabulary never gathered: chunked, vocabulary-parallel log-softmax). On the last pipeline
    stage; None elsewhere. Collective over the model-parallel ranks."""
    from gspo_mcore.logprobs import token_logprobs

    tp = parallel_state.get_tensor_model_parallel_world_size()
    microbatches = []
    for seq in sequences:
        tokens = torch.tensor([seq + [0] * (-(len(seq) - 1) % tp)])  # a multiple of TP: sequence parallel
        microbatches.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "length": len(seq) - 1})

    def collect(mb):
        def loss_func(logits):
            logprobs, _ = token_logprobs(logits, mb["targets"], temperature=temperature,
                                         group=parallel_state.get_tensor_model_parallel_group())
            return logits.new_zeros(()), {"logprobs": logprobs[0, : mb["length"]].float()}
        return loss_func

    outputs = run_schedule(model, microbatches, collect, forward_only=True)
    if not parallel_state.is_pipeline_last_stage():
        return None
    return [out["logprobs"].cpu().tolist() for out in outputs]


def last_stage_rank() -> int:
    """A global rank on the last pipeline stage (Megatron's rank order puts the last rank there)."""
    return dist.get_world_size() - 1


