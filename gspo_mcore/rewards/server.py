"""A reward model behind an SGLang server, for rewards named in the config (docs/05-data-and-rewards.md).

SGLang serves a reward model (a `...ForSequenceClassification` / `...ForRewardModel`
checkpoint, started with `--is-embedding`) at `/classify`: texts in, one score each out. A
batched reward formats each (prompt, response) with the reward model's chat template and calls
`classify(url, texts)`; the runner's time limit and worker pool apply to it like any reward.
"""

from __future__ import annotations

from gspo_mcore.common.http import HTTPRequestError, post_json


def classify(url: str, texts: list[str], timeout_s: float = 60.0, api_key: str | None = None) -> list[float]:
    """The server's score of each text, in order. Raises RuntimeError naming the server on a
    failed request or an answer that is not one score per text (the runner counts the group as
    failed)."""
    try:
        answer = post_json(f"{url.rstrip('/')}/classify", {"text": texts}, timeout_s, api_key)
    except HTTPRequestError as err:
        raise RuntimeError(f"reward server {url}: {err}") from None
    try:
        scores = [float(item["embedding"][0]) for item in answer]
    except (KeyError, IndexError, TypeError, ValueError):
        raise RuntimeError(f"reward server {url}: not a /classify answer: {str(answer)[:100]!r}") from None
    if len(scores) != len(texts):
        raise RuntimeError(f"reward server {url}: {len(scores)} scores for {len(texts)} texts")
    return scores
