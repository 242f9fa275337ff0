"""The project's errors by cause, and how command-line entry points report them.

- `InputError`: bad input (a file, tensor or config field); the message names it. Exit code 2.
- `EngineError`: an inference engine that failed us (gone, refusing, answering garbage, or
  holding other weights than the trainer's); the message names the server or request. Exit code 3.
- Anything else is a bug: a traceback.
"""

from __future__ import annotations

import sys
from typing import Callable


class InputError(ValueError):
    """Bad input (a file, tensor or config field); the message names it. CLIs print it as
    one line and exit 2 instead of a traceback."""


class CheckpointError(InputError):
    """A checkpoint file or tensor that cannot be used."""


class EngineError(RuntimeError):
    """An inference engine failed (not the user's input); one line at the CLI, exit 3."""


class RolloutError(EngineError):
    """A response that cannot be trained on; the message names the request."""


class RequestRefused(RolloutError):
    """The engine refused a request as asked (HTTP 4xx: too long for its context, a bad
    parameter): the asker's doing, not the engine's failure; the message quotes the engine."""


class WeightSyncError(EngineError):
    """The engine did not take the trainer's weights (or the check found them different)."""


EXIT_CODES = {InputError: 2, EngineError: 3}


def run_cli(main: Callable[[], int]) -> int:
    try:
        return main()
    except (InputError, EngineError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_CODES[InputError if isinstance(err, InputError) else EngineError]
