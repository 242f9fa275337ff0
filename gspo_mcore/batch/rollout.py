"""The trainer's samples: what an engine's response becomes (`Rollout`), whatever the engine.

Engines produce them (gspo_mcore.engines), rollout functions assemble multi-turn ones
(gspo_mcore.batch.trajectory), the learner and the models consume them; nothing here knows an engine.
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
    # The engine's routed experts (`rollout.return_routed_experts`): uint8 (or wider past 256
    # experts) [n, layers, top-k], row t for the forward whose input is token t of prompt +
    # response (the last token is never an input); global expert ids; a dense layer's entries
    # unused. On a trainer rank: only its MoE layers (gspo_mcore.megatron.routing_delivery).
    routed_experts: np.ndarray | None = None
    # The weight version (the trainer step whose weights made it) of each response token; a
    # response continued across weight updates (asynchronous modes) spans several.
    token_versions: tuple[int, ...] = ()
    # Per response token: 1 for the model's tokens (trained on), 0 for tokens an environment
    # inserted between turns (a multi-turn trajectory: gspo_mcore.batch.trajectory); their
    # `logprobs` entries are 0 and never read. Empty: every token is the model's.
    loss_mask: tuple[float, ...] = ()
    reward: float | None = None  # set once scored (gspo_mcore.rollout.source)
    # Why it scored so, where the reward says (RewardStats.reasons): OUTPUT_DIR/samples shows it.
    reward_reason: object = None
    # The requests it came from, one per model turn: "SERVER_URL id=ENGINE_REQUEST_ID" (what
    # train.strict_exactness's evidence names, to find them in the server's log).
    origin: tuple[str, ...] = ()

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


@dataclass
class Batch:
    """One step's training data, with the facts the learner needs about it (so nothing downstream
    of the producer asks which `rollout.mode` made it or how the engine behaves)."""
    rollouts: list[Rollout]
    advantages: list[float]  # one per rollout
    metrics: dict  # the rollout figures (metric_schema rows)
    # Generated beside training (the asynchronous modes): the batch may span weight versions, the
    # trainer's wait and the engine's pause are figures of the step.
    overlapped: bool = False
    # Per rollout and response token: 1.0 where weights older than the ones being updated generated
    # it. None: every token came from those weights (a synchronous batch).
    stale: list[list[float]] | None = None
    # Per rollout: whether older weights than these routed it in the engine (None: none did).
    routed_by_older: list[bool] | None = None
    # The update's minibatches (rollout indices), split once when the trainer prepares the batch
    # (gspo_mcore.megatron.learner.Learner.minibatch_split): the routing delivery and the update read the same.
    minibatches: list[list[int]] | None = None

    @classmethod
    def spanning(cls, rollouts: list[Rollout], advantages: list[float], metrics: dict, version: int) -> "Batch":
        """A batch generated beside training, updated at weight version `version`. A response
        continued after a push was prefilled again under the new weights (the `Engine` invariant),
        so its routing is all of its last token's version's (an environment's tokens carry the
        version of the model token before them)."""
        stale = [[float(v < version) for v in r.token_versions] or [0.0] * len(r.response_ids) for r in rollouts]
        older = [bool(tokens) and tokens[-1] > 0 for tokens in stale]
        return cls(rollouts, advantages, metrics, overlapped=True, stale=stale, routed_by_older=older)
