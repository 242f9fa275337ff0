"""Tools named by import path in tests/test_tools.py, written as Hugging Face tools are."""

import os
import time

TABLE = {"paris": "France", "rome": "Italy"}


def lookup(key: str) -> str:
    """Look up which country a city is in.

    Args:
        key: The city, lower case.
    """
    return TABLE.get(key, "unknown")


def add(a: int, b: int = 0) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def explode(reason: str) -> str:
    """Always fails.

    Args:
        reason: What to fail with.
    """
    raise ValueError(reason)


def sleep_forever() -> str:
    """Never returns."""
    while True:
        time.sleep(60)


def huge(size: int) -> str:
    """A long string.

    Args:
        size: How many characters.
    """
    return "x" * size


def record(city: str) -> dict:
    """A record, as a dict.

    Args:
        city: The city.
    """
    return {"city": city, "country": TABLE.get(city), "known": city in TABLE}


def not_text() -> object:
    """Returns something JSON cannot write."""
    return object()


def env_var(name: str) -> str:
    """An environment variable of the process the tool runs in.

    Args:
        name: The variable.
    """
    return os.environ.get(name)


def chatty(key: str) -> str:
    """Prints before it answers.

    Args:
        key: Echoed back.
    """
    print("a tool that prints must not corrupt the worker's replies")
    return key


def undocumented(key: str) -> str:
    return key


def unhinted(key):
    """No type hint.

    Args:
        key: Anything.
    """
    return key


def backtrack() -> str:
    """Never returns, stuck in C (a regular expression's exponential backtracking) without
    letting another thread of its process run."""
    import re

    return str(re.match(r"(a+)+$", "a" * 60 + "b"))


def heavy_modules() -> list:
    """Which of the trainer's heavy packages the tool's process has imported."""
    import sys

    return [name for name in ("torch", "transformers", "megatron", "gspo_mcore.tools.runner") if name in sys.modules]
