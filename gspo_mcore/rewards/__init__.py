"""Reward functions, chosen by name: a built-in or any `module:function`.

A reward is `reward(response: str, answer: str) -> float`; it gets more of the prompt's record
by naming it as a parameter (read from its signature):
- `prompt`: the record's prompt (for a chat record, the last user message's content);
- `messages`: the record's chat (a prompt record as one user message);
- `extra`: the record's other fields, a dict; a parameter named after one field gets that field;
- `url`: `reward.url` (a reward model behind a server, gspo_mcore.rewards.server).
With `reward.batched` it scores a prompt's whole group in one call:
`reward(responses: list[str], answers: list[str], **the same as lists; url as is) -> list[float]`.

Built in: `math` (final \\boxed{} answer, equivalence checked by math-verify), `exact_match`, and
`code` / `code_all` (the last code block run on the problem's tests in the sandbox: gspo_mcore.rewards.code)."""

from __future__ import annotations

import inspect
from typing import Callable

from gspo_mcore.common.errors import InputError
from gspo_mcore.common.plugins import by_name
from gspo_mcore.rewards.answers import exact_match_reward, math_reward


# The code rewards are imported at their first call, not here: `python -m gspo_mcore.rewards.code`
# (the scoring command) must not find its module already imported by this package.
def code_reward(response: str, answer: str) -> float:
    """gspo_mcore.rewards.code.code_reward: the training subset of the problem's tests."""
    from gspo_mcore.rewards import code

    return code.code_reward(response, answer)


def code_all_reward(response: str, answer: str) -> float:
    """gspo_mcore.rewards.code.code_all_reward: every test of the problem."""
    from gspo_mcore.rewards import code

    return code.code_all_reward(response, answer)


def _code_metrics() -> dict:
    from gspo_mcore.rewards import code

    return code.reward_metrics()


def _code_options(options: dict) -> None:
    from gspo_mcore.rewards import code

    code.reward_options(options)


def _code_check_answer(answer: str, where: str) -> None:
    from gspo_mcore.rewards import code

    code.reward_check_answer(answer, where)


def _code_reasons() -> list:
    from gspo_mcore.rewards import code

    return code.reward_reasons()


# A reward worker's hooks (gspo_mcore.rewards.worker): the counts it reports, why each response
# scored so, reward.code's settings; the runner's at data load: each answer read as the reward will read it.
code_reward.reward_metrics = code_all_reward.reward_metrics = _code_metrics
code_reward.reward_options = code_all_reward.reward_options = _code_options
code_reward.reward_check_answer = code_all_reward.reward_check_answer = _code_check_answer
code_reward.reward_reasons = code_all_reward.reward_reasons = _code_reasons


RewardFn = Callable[..., float]
BUILT_IN: dict[str, RewardFn] = {"math": math_reward, "exact_match": exact_match_reward, "code": code_reward,
                                 "code_all": code_all_reward}
CONTEXT = ("prompt", "messages", "extra")  # what a reward may ask for about the prompt's record


def load_reward_fn(name: str) -> RewardFn:
    return by_name(name, BUILT_IN, "reward")


def reward_arguments(fn: RewardFn, name: str, url: str | None = None) -> tuple[str, ...]:
    """The keyword arguments `fn` asks for beyond (response, answer): names of CONTEXT, `url`,
    or record fields. One-line InputErrors for a signature that cannot be served."""
    params = list(inspect.signature(fn).parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 2 and not any(p.kind == p.VAR_POSITIONAL for p in params):
        raise InputError(f"reward {name!r}: takes {len(positional)} positional parameters, expected "
                         "(response, answer, ...)")
    if any(p.kind == p.POSITIONAL_ONLY for p in positional[2:]):
        raise InputError(f"reward {name!r}: parameters after (response, answer) must be nameable")
    named = {p.name: p for p in positional[2:] + [p for p in params if p.kind == p.KEYWORD_ONLY]}
    if any(p.kind == p.VAR_KEYWORD for p in params):  # **kwargs: everything there is
        named.update({key: None for key in (*CONTEXT, *(["url"] if url else []))})
    if url and "url" not in named:
        raise InputError(f"reward.url: reward {name!r} takes no `url` parameter")
    if not url and "url" in named and (named["url"] is None or named["url"].default is inspect.Parameter.empty):
        raise InputError(f"reward {name!r}: takes `url`, but reward.url is not set")
    return tuple(key for key in named if key != "url" or url)


def call_arguments(wanted: tuple[str, ...], context: dict, url: str | None) -> dict:
    """The keyword arguments for one response: `context` has CONTEXT's keys. A record field the
    record lacks is left out (the reward's default applies; without one the call fails, counted)."""
    out = {}
    for key in wanted:
        if key == "url":
            out[key] = url
        elif key in CONTEXT:
            out[key] = context[key]
        elif key in context["extra"]:
            out[key] = context["extra"][key]
    return out
