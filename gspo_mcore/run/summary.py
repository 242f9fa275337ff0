"""A finished run in a few figures, printed at its end and written to OUTPUT_DIR/summary.json: the
mean reward of its first and last steps (10 each, or half the run when shorter) and each held-out
score before training and after (eval.jsonl's first and last rows), so that comparing two runs
(GSPO against GRPO) needs no arithmetic by hand."""

from __future__ import annotations

import json
from pathlib import Path

from gspo_mcore.common.files import atomic_output

WINDOW = 10  # steps at each end


def summarize(output_dir: Path) -> dict:
    """The run's summary from its metrics.jsonl and eval.jsonl (rows as written, a resumed run's
    whole history)."""
    rows = _rows(output_dir / "metrics.jsonl")
    rewards = [r["reward_mean"] for r in rows if r.get("reward_mean") is not None]
    window = max(1, min(WINDOW, len(rewards) // 2))
    out: dict = {"steps": rows[-1]["step"] if rows else 0, "window": window}
    if rewards:
        first, last = sum(rewards[:window]) / window, sum(rewards[-window:]) / window
        out.update(reward_first=first, reward_last=last, reward_gain=last - first)
    evals = _rows(output_dir / "eval.jsonl")
    if len(evals) >= 1:
        before, after = evals[0], evals[-1]
        out["held_out"] = {key: {"before": before.get(key), "after": after[key], "before_step": before["step"],
                                 "after_step": after["step"]}
                           for key in after if key.startswith("eval/") and "/mean@" in key}
    return out


def lines(summary: dict) -> list[str]:
    """What the run prints at its end."""
    out = []
    if "reward_first" in summary:
        n = summary["window"]
        out.append(f"mean reward: first {n} steps {summary['reward_first']:.3f} -> last {n} steps "
                   f"{summary['reward_last']:.3f} ({summary['reward_gain']:+.3f})")
    for key, score in summary.get("held_out", {}).items():
        name = key.removeprefix("eval/")
        before = f"{score['before']:.3f}" if score["before"] is not None else "-"
        out.append(f"held-out {name}: step {score['before_step']} {before} -> step {score['after_step']} "
                   f"{score['after']:.3f}")
    return out


def write_summary(output_dir: Path) -> list[str]:
    """OUTPUT_DIR/summary.json (written whole or not at all) and the lines to print."""
    summary = summarize(output_dir)
    with atomic_output(output_dir / "summary.json") as tmp:
        Path(tmp).write_text(json.dumps(summary, indent=1) + "\n")
    return lines(summary)


def _rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
