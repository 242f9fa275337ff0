"""Reward functions: `reward(response: str, answer: str) -> float`, chosen by name.

Built in: `math` (final \\boxed{} answer, equivalence checked by math-verify) and
`exact_match`. Any other reward is named by import path `module:function`."""

from __future__ import annotations

from typing import Callable

from gspo_mcore.plugins import by_name
from gspo_mcore.rewards.answers import exact_match_reward, math_reward

RewardFn = Callable[[str, str], float]
BUILT_IN: dict[str, RewardFn] = {"math": math_reward, "exact_match": exact_match_reward}


def load_reward_fn(name: str) -> RewardFn:
    return by_name(name, BUILT_IN, "reward")
