"""Reward functions named by import path in tests/test_rewards.py."""

import time


def length_reward(response: str, answer: str) -> float:
    return float(len(response))


def moody_reward(response: str, answer: str) -> float:
    if response == "crash":
        raise RuntimeError("reward crashed")
    if response == "hang":
        time.sleep(60)
    if response == "nan":
        return float("nan")
    return 1.0


def always_raises(response: str, answer: str) -> float:
    raise RuntimeError("this reward never works")


def chatty_reward(response: str, answer: str) -> float:
    print("a reward that prints must not corrupt the worker's replies")
    return 0.5
