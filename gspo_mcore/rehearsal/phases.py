"""The rehearsed step, phase by phase, as the production code runs it on any device: two optimizer
steps of one full microbatch (train.max_tokens_per_microbatch: 4 sequences of a quarter each, no
padding) and one of the longest sequence alone (the planner's 512-token prompt + the longest
response), the weight push's gather-and-pack of one bucket, the sync check's trainer forward.

`run_step(learner, config, arch, dp, phase)` calls `phase(name, body)` around each phase's body;
the rehearsal counts fake storages there (gspo_mcore.rehearsal.step.RankRehearsal.phase), the GPU
check the device's allocator (launch/gpucheck/step_memory.py), so both measure the same program.
Nothing here knows which.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

PROMPT_TOKENS = 512  # the planner's probe prompt (planner.cli --prompt-tokens)
SEQUENCES_PER_MICROBATCH = 4  # the full microbatch: 4 sequences of max_tokens / 4 (no padding)
PHASES = ("training", "weight push", "sync check")


@dataclass(frozen=True)
class StepShape:
    """The sequences of the step: `length` tokens each in a full microbatch, `longest` alone (at
    most a microbatch), the sync check's probe of a whole prompt and response."""
    length: int
    longest: int
    probe_tokens: int

    @classmethod
    def of(cls, config) -> "StepShape":
        tokens, sequence = config.train.max_tokens_per_microbatch, PROMPT_TOKENS + config.rollout.max_new_tokens
        return cls(tokens // SEQUENCES_PER_MICROBATCH, min(tokens, sequence), sequence)

    @property
    def step_tokens(self) -> list[list[int]]:
        """Each optimizer step's sequence lengths on one rank (FLOPs grow with them)."""
        full = [self.length] * SEQUENCES_PER_MICROBATCH
        return [full, full, [self.longest]]


def rollouts_for(lengths: list[int], vocab: int, prompt: int = 64):
    """Rollouts of the given input lengths (prompt + response - 1), varied token ids below `vocab`."""
    from gspo_mcore.batch.rollout import Rollout

    ids = min(1000, vocab - 1)
    out = []
    for i, length in enumerate(lengths):
        prompt_len = min(prompt, length // 2)
        response = length + 1 - prompt_len
        out.append(Rollout(prompt_ids=[(7 * i + j) % ids + 1 for j in range(prompt_len)],
                           response_ids=[(11 * i + j) % ids + 1 for j in range(response)],
                           logprobs=[-0.5] * response, finish_reason="stop", weight_version="step-0"))
    return out


def push_one_bucket(learner, config, arch, dtype) -> None:
    """The weight push's gather-and-pack of one bucket (weight_sync.buckets.owned_rounds' first
    round, packed as both engines read it: capabilities.UpdateSession.pack_bucket); the engine's
    side (its receive buffers, HTTP) is not part of it."""
    from gspo_mcore.engines.capabilities import UpdateSession
    from gspo_mcore.weight_sync.buckets import owned_rounds

    learner.ddp.eval()
    rounds = owned_rounds(learner.model, arch, config.model.spec, config.weight_sync.bucket_mb << 20, dtype)
    _, bucket = next(rounds)
    flat = UpdateSession.pack_bucket(None, bucket) if bucket else None
    del flat, bucket
    rounds.close()


def sync_check_forward(learner, config, probe_tokens: int, vocab: int) -> None:
    """The sync check's trainer forward (weight_sync.check.check_sync's sequence_logprobs) of one
    probe of `probe_tokens` tokens; the engines' answers are not part of it."""
    from gspo_mcore.megatron.qwen3_moe.forward import sequence_logprobs

    probe = [(13 * j) % min(1000, vocab - 1) + 1 for j in range(probe_tokens)]
    sequence_logprobs(learner.ddp, [probe], fused_logprobs=config.model.fused_logprobs)


def run_step(learner, config, arch, dp: int, phase: Callable[[str, Callable[[], None]], None]) -> StepShape:
    """The step's phases on `learner`, each body run by `phase(name, body)`; the step's shape."""
    import torch

    from gspo_mcore.batch.rollout import Batch

    shape, vocab = StepShape.of(config), arch.vocab_size
    full = rollouts_for([shape.length] * (SEQUENCES_PER_MICROBATCH * dp), vocab)
    alone = rollouts_for([shape.longest] * dp, vocab)
    for step, rollouts in ((1, full), (2, full), (3, alone)):
        advantages = [1.0 if i % 2 else -1.0 for i in range(len(rollouts))]
        batch = Batch(rollouts, advantages, {}, minibatches=[list(range(len(rollouts)))])
        phase("training", lambda: learner.update(batch, step))
    if config.optimizer.offload_grad_buffers:
        learner.offload_grad_buffers()  # as the trainer does before the engine's phases
    dtype = getattr(torch, config.rollout.engine_dtype)
    phase("weight push", lambda: push_one_bucket(learner, config, arch, dtype))
    phase("sync check", lambda: sync_check_forward(learner, config, shape.probe_tokens, vocab))
    return shape
