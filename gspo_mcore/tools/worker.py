"""A tool worker: `python -m gspo_mcore.tools.worker MAX_OUTPUT_CHARS NAME...`.

Imports only the tools (`module:function`; not the trainer, torch or transformers), says
`ready`, then answers one JSON line per request on a private pipe:
`{"name": ..., "arguments": {...}}` -> `{"content": "..."}` (the tool's text for the model) or
`{"error": "..."}` (a message for the model: the tool raised or returned something that is not
text). Both are cut to MAX_OUTPUT_CHARS. The tools' own prints go to stderr, so they cannot
corrupt the protocol. Ends at end of input, or when the process that started it is gone (a tool
may hang, and a killed trainer must leave no worker behind)."""

from __future__ import annotations

import json
import os
import sys

from gspo_mcore.common.processes import exit_with_parent


def clip(text: str, limit: int) -> str:
    """`text`, or its first `limit` characters and a marker saying how many were cut."""
    return text if len(text) <= limit else f"{text[:limit]}...[truncated {len(text) - limit} chars]"


def as_text(value) -> str:
    """A tool's return value as the text the model reads: a string as is, anything JSON can
    write (numbers, lists, dicts) as JSON, which the model reads as it reads the schemas."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):
        raise TypeError(f"returned {type(value).__name__}, not text or JSON") from None


def answer(functions: dict, request: dict) -> dict:
    name = request["name"]
    try:
        value = functions[name](**request["arguments"])
    except Exception as err:
        return {"error": f"error: tool {name!r} raised {type(err).__name__}: {err}"}
    try:
        return {"content": as_text(value)}
    except TypeError as err:
        return {"error": f"error: tool {name!r} {err}"}


def main() -> int:
    exit_with_parent()
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else written to stdout goes to stderr
    sys.stdout = sys.stderr
    from gspo_mcore.common.plugins import by_name  # after stdout is redirected: a tool's import may print

    limit, names = int(sys.argv[1]), sys.argv[2:]
    try:
        functions = {fn.__name__: fn for fn in (by_name(name, {}, "tool") for name in names)}
    except Exception as err:  # reported by the runner as the reason the worker did not start
        protocol.write(json.dumps({"error": f"{type(err).__name__}: {err}"}) + "\n")
        return 2
    protocol.write('"ready"\n')
    for line in sys.stdin:
        reply = answer(functions, json.loads(line))
        protocol.write(json.dumps({key: clip(text, limit) for key, text in reply.items()}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
