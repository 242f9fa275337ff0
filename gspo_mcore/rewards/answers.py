"""Answer extraction and the built-in rewards."""

from __future__ import annotations

import re


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}) in `text`, braces balanced."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    if not starts:
        return None
    start, depth = starts[-1], 1
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i].strip()
    return None  # unbalanced: the response was cut off


def math_reward(response: str, answer: str) -> float:
    """1.0 if the response's final boxed answer is mathematically equivalent to `answer`."""
    from math_verify import parse, verify  # heavy: loaded by the reward worker that uses it

    predicted = last_boxed(response)
    if predicted is None:
        return 0.0
    gold = parse(f"${answer}$")
    guess = parse(f"${predicted}$")
    if not gold or not guess:
        return float(predicted.strip() == answer.strip())
    return 1.0 if verify(gold, guess) else 0.0


def exact_match_reward(response: str, answer: str) -> float:
    """1.0 if the final boxed answer (or, without one, the whole response) equals `answer`
    after collapsing whitespace."""
    predicted = last_boxed(response)
    predicted = response if predicted is None else predicted
    return float(" ".join(predicted.split()) == " ".join(answer.split()))
