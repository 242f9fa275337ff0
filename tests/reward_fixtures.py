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


def prompt_reward(response: str, answer: str, prompt: str) -> float:
    """1.0 when the response repeats the prompt's question: a reward that needs the prompt."""
    return float(response == prompt)


def field_reward(response: str, answer: str, level: str = "none", *, extra: dict, messages: list) -> float:
    """A record field by name, all the fields, and the chat."""
    return float(level == "Level 2") + 10 * len(extra) + 100 * len(messages)


def group_sizes(responses: list, answers: list) -> list:
    """Batched: each response scores the size of the call it came in."""
    if responses[0] == "wrong length":
        return [1.0]
    return [float(len(responses))] * len(responses)


def scored_by_server(responses: list, answers: list, messages: list, url: str) -> list:
    """A reward model behind a server: the chat's user turn and the response as one text."""
    from gspo_mcore.rewards.server import classify

    return classify(url, [f"{m[-1]['content']} => {r}" for m, r in zip(messages, responses)])


def one_argument(response: str) -> float:
    return 0.0


def category_from_prompt(response: str, answer: str, prompt: str) -> float:
    """The toy task's reward with the category read from the prompt, not the answer field."""
    asked = prompt.split()[2]  # "name a color ( ... )"
    words = response.split()
    return 1.0 if words and words[0].startswith(f"{asked}_") else 0.0


def zero_reward(response: str, answer: str) -> float:
    return 0.0


def category_group_reward(responses: list, answers: list) -> list:
    """The toy task's reward, batched (reward.batched: true): a group's lists in one call."""
    from gspo_mcore.tasks.toy import category_reward

    return [category_reward(r, a) for r, a in zip(responses, answers)]


def category_or_raise(response: str, answer: str) -> float:
    """1.0 for a right toy answer; a wrong one makes it raise (a reward that fails on some responses)."""
    if not response.split()[0].startswith(f"{answer}_"):
        raise RuntimeError(f"cannot score {response!r}")
    return 1.0


def slow_reward(response: str, answer: str) -> float:
    """Scores after a second: a close of the run's source meets it mid-score."""
    time.sleep(1.0)
    return 1.0


def category_saying_why(response: str, answer: str) -> float:
    """category_reward, which says why a response scored 0 (its reward_reasons hook)."""
    from gspo_mcore.tasks.toy import category_reward

    score = category_reward(response, answer)
    category_saying_why.last = [None if score else f"not a {answer}: {response.split()[:1]}"]
    return score


category_saying_why.reward_reasons = lambda: category_saying_why.last


def reasons_not_json(response: str, answer: str) -> float:
    return 0.0


reasons_not_json.reward_reasons = lambda: [{"seen": {1, 2}}]  # a set: not JSON
