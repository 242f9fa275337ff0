"""A run's samples on disk (train.log_samples_every): training responses and evaluation ones."""

from __future__ import annotations

import json
from pathlib import Path

from gspo_mcore.common.files import atomic_output


def write_samples(path: Path, tokenizer, rollouts: list, eval_samples: list[dict],
                  advantages: list[float] = ()) -> None:
    """Training responses (prompt, response, reward, its advantage where given, and the reward's
    reason where it gave one: the code reward's first failing test) and evaluation ones, a JSON
    object per line."""
    rows = [{"prompt": tokenizer.decode(r.prompt_ids, skip_special_tokens=True),
             "response": tokenizer.decode(r.response_ids, skip_special_tokens=True), "reward": r.reward,
             **({"advantage": advantages[i]} if i < len(advantages) else {}),
             **({"reason": r.reward_reason} if r.reward_reason is not None else {})}
            for i, r in enumerate(rollouts)] + eval_samples
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(path) as tmp:
        tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
