"""The stable import path for extension code: rewards, rollout functions, tools, group filters
and losses import from here (`from gspo_mcore.api import Trajectory`), never from the module that
happens to define a name today. A name listed here keeps working across moves; a name that
leaves goes through a release of `gspo_mcore.common.deprecation` warnings first.

Names load on first use (PEP 562 `__getattr__`): a reward worker that imports `classify` does
not import torch, and a loss does not import the rollout client.

What each extension point gets (docs/03-multi-turn.md, docs/05-data-and-rewards.md, docs/07-loss.md):
- `rollout.function: module:function`: `async def fn(task: Task, engine: EngineHandle) ->
  Trajectory | list[Trajectory]`; `engine.generate` returns a `Rollout` (one model turn).
- `reward.name: module:function`: a plain function of the record's fields; a reward model is
  `classify(url, texts)`.
- `rollout.tools`: plain typed functions; nothing to import.
- `rollout.group_filter: module:function`: `fn(rewards, group_ids) -> bool mask`.
- `loss.function: module:function`: `fn(inputs: LossInputs, config: LossConfig) -> (loss,
  metrics)`, reduced with `aggregate(token_loss, mask, aggregation, inputs.normalizer)`.
"""

from __future__ import annotations

import importlib

# name -> the module that defines it today (the only place that knows).
_HOMES = {
    # rollout functions
    "Task": "gspo_mcore.rollout.engine_handle",
    "EngineHandle": "gspo_mcore.rollout.engine_handle",
    "RolloutFunction": "gspo_mcore.rollout.functions",
    "Trajectory": "gspo_mcore.batch.trajectory",
    "Segment": "gspo_mcore.batch.trajectory",
    "Rollout": "gspo_mcore.batch.rollout",
    # rewards
    "classify": "gspo_mcore.rewards.server",
    # losses
    "LossInputs": "gspo_mcore.gspo.loss",
    "LossFunction": "gspo_mcore.gspo.loss",
    "Normalizer": "gspo_mcore.gspo.loss",
    "aggregate": "gspo_mcore.gspo.loss",
    "policy_loss": "gspo_mcore.gspo.loss",
    "sequence_log_ratio": "gspo_mcore.gspo.loss",
    "kl_penalty": "gspo_mcore.gspo.loss",
    "LossConfig": "gspo_mcore.config",
    # errors an extension may raise: a one-line refusal of the user's input (exit 2)
    "InputError": "gspo_mcore.common.errors",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
