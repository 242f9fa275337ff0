"""Reward functions: `reward(response: str, answer: str) -> float`, chosen by name.

Built in: `math` (final \\boxed{} answer, equivalence checked by math-verify) and
`exact_match`. Any other reward is named by import path `module:function`."""

from __future__ import annotations

import importlib
from typing import Callable

from gspo_mcore.errors import InputError
from gspo_mcore.rewards.answers import exact_match_reward, math_reward

RewardFn = Callable[[str, str], float]
BUILT_IN: dict[str, RewardFn] = {"math": math_reward, "exact_match": exact_match_reward}


def load_reward_fn(name: str) -> RewardFn:
    if name in BUILT_IN:
        return BUILT_IN[name]
    module_name, sep, function_name = name.partition(":")
    if not sep:
        raise InputError(f"reward {name!r}: not one of {sorted(BUILT_IN)} nor 'module:function'")
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as err:
        raise InputError(f"reward {name!r}: cannot import ({err})") from None
    if not callable(function):
        raise InputError(f"reward {name!r}: not callable")
    return function
