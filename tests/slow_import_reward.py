"""A reward module that takes 1.5 s to import (like one that loads a checker or a tokenizer)."""

import time

time.sleep(1.5)


def reward(response: str, answer: str) -> float:
    return 1.0
