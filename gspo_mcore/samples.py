"""The trainer's samples: what an engine's response becomes (`Rollout`), whatever the engine.

Engines produce them (gspo_mcore.engines), rollout functions assemble multi-turn ones
(gspo_mcore.trajectory), the learner and the models consume them; nothing here knows an engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Rollout:
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]  # the engine's log-prob of each response token: its behaviour policy's
    finish_reason: str  # "stop" | "length"
    weight_version: str  # the version of the response's last token
    # The engine's routed experts (`rollout.return_routed_experts`): int32 [n, MoE layers,
    # top-k], row t for the forward whose input is token t of prompt + response (the last
    # token is never an input); global expert ids.
    routed_experts: np.ndarray | None = None
    # The weight version (the trainer step whose weights made it) of each response token; a
    # response continued across weight updates (asynchronous modes) spans several.
    token_versions: tuple[int, ...] = ()
    # Per response token: 1 for the model's tokens (trained on), 0 for tokens an environment
    # inserted between turns (a multi-turn trajectory: gspo_mcore.trajectory); their
    # `logprobs` entries are 0 and never read. Empty: every token is the model's.
    loss_mask: tuple[float, ...] = ()
    reward: float | None = None  # set once scored (gspo_mcore.rollout.source)

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"

    @property
    def mask(self) -> list[float]:
        """1 per response token the loss trains on."""
        return list(self.loss_mask) if self.loss_mask else [1.0] * len(self.response_ids)

    @property
    def oldest_version(self) -> int | None:
        return min(self.token_versions) if self.token_versions else None


def version_number(version: str) -> int | None:
    """The trainer step of a weight version the trainer tagged (`step-N`); None for others."""
    prefix, _, number = version.partition("-")
    return int(number) if prefix == "step" and number.isdigit() else None
