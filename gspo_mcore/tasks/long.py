"""A CPU task with long responses whose reward depends on every token: "name 40 animals".

The toy task (gspo_mcore/tasks/toy.py) rewards one word, so its responses are ~3 tokens and the
sequence-level ratio of GSPO is hardly different from a token ratio. This task keeps the toy's
vocabulary, tokenizer, tiny model and prompts, and asks for a list instead:

    user: name an animal ( fruit_3 color_44 number_9 ) assistant: animal_5 animal_17 ... <eos>

The reward is the fraction of the first `RESPONSE_WORDS` (40) words of the response that
belong to the asked category; a response that stops early has its missing words counted as
wrong. So every position moves the reward by 1/40, and stopping early costs. The answer field
holds the category and the count ("animal 40"). Measured on the random tiny model (fp32,
temperature 1, 128 samples): reward 0.21 (60/256 ~ 0.23 per word, less for early stops), mean
length 35 tokens (23% of responses stop before 40); rollout.max_new_tokens must be the count.

`python -m gspo_mcore.tasks.long OUT_DIR` writes OUT_DIR/model (the toy task's model and
tokenizer, same seed, same weights) and OUT_DIR/prompts.jsonl, to a temporary sibling first;
the same seed gives the same files.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

from gspo_mcore.tasks import toy

RESPONSE_WORDS = 40


def list_reward(response: str, answer: str) -> float:
    """Fraction of the first N words of `response` in the category; `answer` is "CATEGORY N"."""
    category, count = answer.split()
    words = response.split()[: int(count)]
    return sum(word.startswith(f"{category}_") for word in words) / int(count)


def make_prompts(path: Path, count: int, seed: int, words: int = RESPONSE_WORDS) -> None:
    """The toy task's prompts (same seed, same requests), each answer extended by the count."""
    toy.make_prompts(path, count, seed)
    records = [json.loads(line) for line in Path(path).read_text().splitlines()]
    Path(path).write_text("".join(json.dumps({**r, "answer": f"{r['answer']} {words}"}) + "\n" for r in records))


def make_long_task(out_dir, seed: int = 0, num_prompts: int = 1024, words: int = RESPONSE_WORDS) -> Path:
    return toy.make_toy_task(out_dir, seed, num_prompts, write_prompts=partial(make_prompts, words=words))


if __name__ == "__main__":
    toy.writer_cli("gspo_mcore.tasks.long", make_long_task)
