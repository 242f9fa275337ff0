"""The CPU agent task learns (configs/agent_cpu.yaml, 20 of its 30 steps, on the task its writer
ships): the mean reward rises by >= 0.3 from the first 5 steps to the last 5, within 10 minutes, through
the tool loop (every step calls the tool; the environment's tokens are in the trajectories), and
the held-out evaluation, run through the same tool loop, rises with it."""

import json
import subprocess
import sys
import time

import pytest

from helpers import REPO, environment, metrics

# Slow: the writer's warm start (~25 s) and a 20-step run with its own server. Its own xdist group.
# 20 steps: sampling is seeded (#48), and the seeded run rose +0.47 from its first 5 steps to its
# last 5 (+0.34 first 10 to last 10; held-out 0.33 -> 0.80), 2026-11-28; 30 steps took ~90 s more.
STEPS = 20
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("agent_cpu")]


ENV = environment()


@pytest.fixture(scope="module")
def agent_task(tmp_path_factory):
    """The task's writer as a user runs it: a warm-started model, prompts, held-out prompts."""
    root = tmp_path_factory.mktemp("agent")
    subprocess.run([sys.executable, "-m", "gspo_mcore.tasks.agent", str(root / "task")], cwd=REPO, env=ENV,
                   check=True, capture_output=True, timeout=900)
    return root / "task"


@pytest.fixture(scope="module")
def agent_run(agent_task):
    """The run as a user starts it (the README's second command)."""
    root, env = agent_task.parent, ENV
    out = root / "run"
    started = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "gspo_mcore.train", "--config", "configs/agent_cpu.yaml",
                          "--output-dir", str(out), f"model.hf_dir={root / 'task' / 'model'}",
                          f"data.path={root / 'task' / 'prompts.jsonl'}",
                          f"eval.datasets=[{{name: lookup, path: {root / 'task' / 'eval.jsonl'}, samples: 2, "
                          "max_new_tokens: 24}]", f"train.steps={STEPS}"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    return out, time.monotonic() - started


def test_the_agent_task_learns_to_look_up_the_prompts_key_within_ten_minutes(agent_run):
    out, seconds = agent_run
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    rewards = [r["reward_mean"] for r in rows]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last - first >= 0.3, (first, last, rewards)
    assert seconds < 600
    for r in rows:  # the tool loop ran: a call and an answer, the tool's result between them untrained
        assert r["tool_calls_mean"] > 0.5 and r["turns_mean"] > 1.5, r
        assert 0 < r["env_token_fraction"] < 1 and r["trainable_tokens"] > 0


def test_the_held_out_evaluation_runs_the_tool_loop_and_rises(agent_run):
    """Held-out prompts through the tool loop (a single-turn evaluation would never call the tool:
    its answers would be guesses, right 1 time in 32)."""
    out, _ = agent_run
    evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 10, 20]
    accuracy = [e["eval/lookup/mean@2"] for e in evals]
    assert accuracy[0] > 0.1 and accuracy[-1] - accuracy[0] >= 0.3, accuracy
    samples = [json.loads(line) for line in (out / "samples" / f"step_{STEPS:06d}.jsonl").read_text().splitlines()]
    assert any(s.get("eval") == "lookup" for s in samples)
