"""Multi-turn trajectories: token segments, each the model's or the environment's.

A rollout function (gspo_mcore.rollout.functions) builds a `Trajectory` turn by turn from token
ids, never from re-tokenized text: the model's segments are exactly the tokens the engine
sampled, with its per-token log-probs and weight versions; the environment's segments (tool
results, a user's next message, the chat template's turn markers) are tokens the trainer feeds
to the model but never trains on. `to_rollout` flattens it into the trainer's `Rollout`, the
environment's tokens masked out (`Rollout.loss_mask` 0, log-prob 0), so GSPO's length
normalisation, every aggregation and the mismatch figures count the model's tokens only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from gspo_mcore.common.errors import RolloutError
from gspo_mcore.batch.rollout import Rollout


@dataclass
class Segment:
    token_ids: list[int]
    trainable: bool  # the model's tokens (trained on) or the environment's (never)
    logprobs: list[float] = field(default_factory=list)  # the engine's, one per token of a trainable segment
    versions: tuple[int, ...] = ()  # the weight version of each token of a trainable segment (when tagged)
    # The engine's routed experts for this turn's whole request (rollout.return_routed_experts):
    # every token before the turn's last, the earlier turns and environment tokens included.
    routed_experts: np.ndarray | None = None
    origin: tuple[str, ...] = ()  # the request of a model segment (Rollout.origin)


@dataclass
class Trajectory:
    """What a rollout function returns: the prompt, the turns after it, and what to score.
    `text` is what the reward function reads (e.g. the last turn's answer); `reward`, when the
    function sets it (an environment's own score), is used instead. `info` counts what the
    metrics report (tool_calls, tool_errors, tool_timeouts; the model turns are counted for it)."""
    prompt_ids: list[int]
    segments: list[Segment] = field(default_factory=list)
    text: str = ""
    reward: float | None = None
    finish_reason: str = "stop"  # "length": cut by a token budget
    weight_version: str = ""  # the version of the last model token
    info: dict = field(default_factory=dict)

    @property
    def token_ids(self) -> list[int]:
        """Every token after the prompt, in order."""
        return [t for s in self.segments for t in s.token_ids]

    def add_model(self, rollout: Rollout) -> None:
        """A model turn as the engine returned it (gspo_mcore.engines.client.EngineClient.generate_one)."""
        self.segments.append(Segment(list(rollout.response_ids), True, list(rollout.logprobs), rollout.token_versions,
                                     rollout.routed_experts, rollout.origin))
        self.weight_version, self.finish_reason = rollout.weight_version, rollout.finish_reason

    def add_environment(self, token_ids: list[int]) -> None:
        self.segments.append(Segment(list(token_ids), False))


def to_rollout(trajectory: Trajectory, name: str = "") -> Rollout:
    """The trainer's view: response = every segment after the prompt; environment tokens masked
    (log-prob 0, never read), and tagged with the version of the model token before them (the
    staleness bound counts the oldest model token)."""
    response, logprobs, mask, versions, tagged = [], [], [], [], True
    for segment in trajectory.segments:
        tagged &= not segment.trainable or len(segment.versions) == len(segment.token_ids)
        n = len(segment.token_ids)
        if segment.trainable and len(segment.logprobs) != n:
            raise RolloutError(f"trajectory {name}: a model segment of {n} tokens with {len(segment.logprobs)} log-probs")
        response += segment.token_ids
        logprobs += segment.logprobs if segment.trainable else [0.0] * n
        mask += [1.0 if segment.trainable else 0.0] * n
        versions += list(segment.versions) if segment.trainable and tagged else [None] * n
    if not any(mask):
        raise RolloutError(f"trajectory {name}: no model tokens")
    return Rollout(list(trajectory.prompt_ids), response, logprobs, trajectory.finish_reason, trajectory.weight_version,
                   routed_experts=_routing(trajectory, len(trajectory.prompt_ids) + len(response), name),
                   token_versions=_fill_versions(versions) if tagged else (), loss_mask=tuple(mask),
                   origin=tuple(o for s in trajectory.segments for o in s.origin))


def _routing(trajectory: Trajectory, num_tokens: int, name: str) -> np.ndarray | None:
    """The last model turn's routed experts: its request held every earlier token (the engine
    routes a prefix the same whether computed or served from its cache), so they cover every
    segment up to that turn. Environment tokens after it (a function that ends on them) are
    inputs to no trained token (attention is causal): they repeat the last row."""
    last = max(i for i, s in enumerate(trajectory.segments) if s.trainable)
    routed = trajectory.segments[last].routed_experts
    if routed is None:
        if any(s.routed_experts is not None for s in trajectory.segments):
            raise RolloutError(f"trajectory {name}: routed experts for some model turns only")
        return None
    covered = len(trajectory.prompt_ids) - 1 + sum(len(s.token_ids) for s in trajectory.segments[:last + 1])
    if routed.shape[0] != covered:
        raise RolloutError(f"trajectory {name}: the last model turn's routed experts cover {routed.shape[0]} tokens, "
                           f"not the {covered} before its last token (was each turn generated from every token "
                           "before it?)")
    return np.concatenate([routed, np.repeat(routed[-1:], num_tokens - 1 - covered, axis=0)])


def _fill_versions(versions: list[int | None]) -> tuple[int, ...]:
    """Environment tokens take the version of the model token before them (after them at the
    start)."""
    out, last = [], next(v for v in versions if v is not None)
    for v in versions:
        last = v if v is not None else last
        out.append(last)
    return tuple(out)
