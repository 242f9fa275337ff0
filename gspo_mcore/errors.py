"""Errors caused by user input, and how command-line entry points report them."""

from __future__ import annotations

import sys
from typing import Callable


class InputError(ValueError):
    """Bad input (a file, tensor or config field); the message names it. CLIs print it as
    one line and exit 2 instead of a traceback."""


class CheckpointError(InputError):
    """A checkpoint file or tensor that cannot be used."""


def run_cli(main: Callable[[], int]) -> int:
    try:
        return main()
    except InputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
