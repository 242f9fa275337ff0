"""configs/agent_cpu.yaml end to end: the real trainer, a real SGLang server on CPU, the tool
loop calling gspo_mcore.agent_task:lookup in worker processes; the mean reward rises by >= 0.3
from the first 10 steps to the last 10 within 10 minutes on 2 cores."""

import json
import time

import pytest

from conftest import run_module
from gspo_mcore.agent_task import make_agent_task

# Slow: starts torchrun and an SGLang server. Its own xdist group: one run, beside the others.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("agent_cpu")]


def test_the_agent_task_learns_to_ask_the_right_key_within_ten_minutes(tmp_path):
    task = make_agent_task(tmp_path / "task")  # ~20 s: the warm start
    out = tmp_path / "run"
    start = time.monotonic()
    run_module(["-m", "gspo_mcore.train", "--config", "configs/agent_cpu.yaml", "--output-dir", str(out),
                f"model.hf_dir={task / 'model'}", f"data.path={task / 'prompts.jsonl'}", "train.export_hf=false"],
               timeout=900)
    seconds = time.monotonic() - start
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 31))
    first = sum(r["reward_mean"] for r in rows[:10]) / 10
    last = sum(r["reward_mean"] for r in rows[-10:]) / 10
    assert first <= 0.4 and last - first >= 0.3, (first, last)
    assert all(r["tool_calls_mean"] > 0.9 and r["mismatch_abs_log_ratio_max"] < 1e-4 for r in rows)
    assert seconds < 600
