"""A reward module that takes 3 s to import (like one that loads a checker or a tokenizer)."""

import time

time.sleep(3)


def reward(response: str, answer: str) -> float:
    return 1.0
