"""A reward worker: `python -m gspo_mcore.rewards.worker NAME`.

Imports only the reward function (not the trainer, torch or megatron), says `ready`, then
answers one JSON line per request on a private pipe: `[response, answer]` ->
`{"reward": x}` or `{"error": "..."}`. The reward's own prints go to stderr, so they cannot
corrupt the protocol. Ends at end of input (the trainer closed the pipe or died)."""

from __future__ import annotations

import json
import math
import os
import sys


def main() -> int:
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else written to stdout goes to stderr
    sys.stdout = sys.stderr
    from gspo_mcore.rewards import load_reward_fn  # after stdout is redirected: the reward's import may print

    try:
        reward_fn = load_reward_fn(sys.argv[1])
    except Exception as err:  # reported by the runner as the reason the worker did not start
        protocol.write(json.dumps({"error": f"{type(err).__name__}: {err}"}) + "\n")
        return 2
    protocol.write('"ready"\n')
    for line in sys.stdin:
        response, answer = json.loads(line)
        try:
            value = float(reward_fn(response, answer))
            if not math.isfinite(value):  # a NaN would poison the group's advantages
                raise ValueError(f"returned {value}")
            reply = {"reward": value}
        except Exception as err:
            reply = {"error": f"{type(err).__name__}: {err}"}
        protocol.write(json.dumps(reply) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
