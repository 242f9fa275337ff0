"""The check's output: one JSON line per section, and one per part of a section as soon as it is
measured (each learner arm of section 3), printed to stdout and, with `--out DIR`, appended to
DIR/gpu_check.jsonl and flushed to disk at once, so a run killed midway keeps every line it made.

    {"section": N, "name": ..., "result": "PASS" | "FAIL" | "SKIP", "device": ..., "seconds": ...,
     "run": <when the run began>, figures...}
    {"section": N, "part": ..., "result": ..., "run": ..., figures...}
    {"section": "budget", "budget_s": ..., "spent_s": ..., "ran": [N, ...], "left_out": [...]}  (--budget)

A figures dict says its verdict with "pass" (a bool) or "skip" (the reason); "error" names what
raised or died."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

JSONL = "gpu_check.jsonl"


def verdict(figures: dict) -> tuple[str, dict]:
    """(PASS | FAIL | SKIP, the figures without "pass"): SKIP when they carry "skip"; figures
    without a verdict are a FAIL (a section that forgot to judge has not passed)."""
    rest = {k: v for k, v in figures.items() if k != "pass"}
    if "skip" in figures:
        return "SKIP", rest
    return ("PASS" if figures.get("pass") is True else "FAIL"), rest


def error_figures(err: BaseException) -> dict:
    """A raised exception as a FAIL's figures: its type and the start of its message."""
    return {"pass": False, "error": f"{type(err).__name__}: {str(err)[:300]}"}


def section_line(number: int, name: str, device: str, seconds: float, figures: dict) -> dict:
    result, rest = verdict(figures)
    return {"section": number, "name": name, "result": result, "device": device, "seconds": round(seconds, 2), **rest}


def part_line(number: int, part: str, figures: dict) -> dict:
    result, rest = verdict(figures)
    return {"section": number, "part": part, "result": result, **rest}


def budget_line(budget_s: float, spent_s: float, ran: list[int], left_out: list[tuple[int, str, int]]) -> dict:
    """The last line of a run with --budget: what ran and what was left out, with its estimate."""
    return {"section": "budget", "budget_s": budget_s, "spent_s": round(spent_s, 1), "ran": ran,
            "left_out": [{"section": n, "name": name, "estimate_s": estimate} for n, name, estimate in left_out]}


class Lines:
    """Where the lines go: stdout (looked up at each line, so a test's capture sees them) and, given
    a folder, its gpu_check.jsonl (appended: a rerun of one section adds to the first run's lines;
    "run" tells the runs apart)."""

    def __init__(self, run: str, out_dir: Path | None = None):
        self.run, self.out_dir = run, out_dir
        self.path = out_dir / JSONL if out_dir is not None else None
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)

    def emit(self, line: dict) -> dict:
        line = {**line, "run": self.run}
        text = json.dumps(line, default=str)
        print(text, file=sys.stdout, flush=True)
        if self.path is not None:
            with open(self.path, "a") as out:
                out.write(text + "\n")
                out.flush()
                os.fsync(out.fileno())  # on disk before the next section can take the machine down
        return line
