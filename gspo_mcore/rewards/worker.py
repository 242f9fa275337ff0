"""A reward worker: `python -m gspo_mcore.rewards.worker NAME [--batched] [--options JSON]`.

Imports only the reward function (not the trainer, torch or megatron), hands it `--options`
(reward.code's settings) through its `reward_options(options: dict)` hook where it has one, says
`ready`, then answers one JSON line per request on a private pipe: `[[response, answer], kwargs]`
(batched: `[[responses, answers], kwargs of lists]`) -> `{"rewards": [x, ...]}` or
`{"error": "..."}`, with the reward's counts (`metrics`) and reasons (`reasons`) where it has
those hooks. A reward may return None for a response it could not score for a reason not the
response's (the code reward's infrastructure errors, reward.code.infrastructure_errors: mask): null
in the reply, masked by the runner. The reward's own prints go to stderr, so they cannot corrupt the
protocol. Ends at end of input (the trainer closed the pipe or died) or once the process that started it is gone."""

from __future__ import annotations

import json
import math
import os
import sys

from gspo_mcore.common.processes import exit_with_parent


def main() -> int:
    exit_with_parent()  # also when a thread that ended started it (the pipe's end alone was not enough)
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else written to stdout goes to stderr
    sys.stdout = sys.stderr
    from gspo_mcore.rewards import load_reward_fn  # after stdout is redirected: the reward's import may print

    name, flags = sys.argv[1], sys.argv[2:]
    batched = "--batched" in flags
    options = json.loads(flags[flags.index("--options") + 1]) if "--options" in flags else None
    try:
        reward_fn = load_reward_fn(name)
        configure = reward_hook(reward_fn, "reward_options")
        if options is not None and configure is not None:
            configure(options)
    except Exception as err:  # reported by the runner as the reason the worker did not start
        protocol.write(json.dumps({"error": f"{type(err).__name__}: {err}"}) + "\n")
        return 2
    # A reward may count things per call (the code reward's tests, sandbox time, ...): a
    # `reward_metrics() -> {name: number}` hook, the counts since its last call, sent with each reply.
    counts = reward_hook(reward_fn, "reward_metrics")
    # And why each response of the call scored as it did: a `reward_reasons() -> [reason or None, ...]`
    # hook (the code reward's first failing test), sent with a reply that has rewards.
    reasons = reward_hook(reward_fn, "reward_reasons")
    protocol.write('"ready"\n')
    for line in sys.stdin:
        args, kwargs = json.loads(line)
        try:
            reply = {"rewards": call(reward_fn, args, kwargs, batched)}
            if reasons is not None:
                reply["reasons"] = reasons()  # a reason that is not JSON is sent as its str (below)
        except Exception as err:
            reply = {"error": f"{type(err).__name__}: {err}"}
        if counts is not None:
            reply["metrics"] = counts()
        protocol.write(json.dumps(reply, default=str) + "\n")
    return 0


def reward_hook(reward_fn, name: str):
    """An attribute `name` of the reward function, or else of its module; None (the runner's
    data-load check looks its hook up the same way)."""
    return getattr(reward_fn, name, None) or getattr(
        sys.modules.get(getattr(reward_fn, "__module__", ""), None), name, None)


def call(reward_fn, args: list, kwargs: dict, batched: bool) -> list[float | None]:
    """The rewards of one request, checked: a NaN would poison the group's advantages (None, a
    masked response, is kept apart from them by the runner and the rollout source)."""
    values = reward_fn(*args, **kwargs)
    if not batched:
        values = [values]
    elif len(values) != len(args[0]):
        raise ValueError(f"returned {len(values)} rewards for {len(args[0])} responses")
    values = [None if v is None else float(v) for v in values]
    if not all(v is None or math.isfinite(v) for v in values):
        raise ValueError(f"returned {next(v for v in values if v is not None and not math.isfinite(v))}")
    return values


if __name__ == "__main__":
    sys.exit(main())
