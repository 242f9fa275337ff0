"""Asynchronous GSPO end to end on CPU: generation overlapping training against real SGLang
servers (two of them) under DP2 and EP2, the staleness bound held and reported every step, and
an asynchronous run killed (SIGKILL) with groups in flight, then resumed."""

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO
from test_train import _metrics, _toy_overrides, _train, toy  # noqa: F401 (toy is a fixture)

pytestmark = pytest.mark.slow  # starts torchrun and SGLang servers

COMMON = ["rollout.num_servers=2", "reward.norm=group", "train.export_hf=false", "weight_sync.check_every=2"]


@pytest.mark.parametrize("mode, layout", [("async", "distributed.expert_parallel=2"), ("one_step_off", "")])
def test_asynchronous_modes_train_with_bounded_staleness(toy, tmp_path, mode, layout):
    """EP2 (async) and DP2 (one_step_off), two servers: full batches, every step's staleness within
    rollout.max_staleness, the trainer not waiting once generation runs ahead, weights checked."""
    out = tmp_path / "run"
    _train(out, [*_toy_overrides(toy), *COMMON, f"rollout.mode={mode}", "train.steps=3", "train.save_every=0",
                 *([layout] if layout else [])], nproc=2)
    rows = _metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        # async refills continuously; one_step_off keeps sync's rounds (rollout.max_sampling_rounds: 1 here)
        assert r["samples"] == 8 * r["groups_kept"] and (mode != "async" or r["groups_kept"] == 16)
        assert 0 <= r["staleness_max"] <= 1 and r["engine_pause_s"] > 0
        assert 0 <= r["trainer_idle_fraction"] <= 1 and r["behavior_weight_mean"] > 0
    assert any(r["staleness_max"] == 1 for r in rows[1:])  # generation overlapped an update
    assert [r["sync_check_median"] < 1e-4 for r in rows if "sync_check_median" in r] == [True]


def test_an_async_run_killed_with_groups_in_flight_resumes(toy, tmp_path):
    """SIGKILL mid-run (groups in flight on the server), then --resume: the run continues from its
    last checkpoint, the in-flight groups dropped and their prompts admitted again in order."""
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-m", "gspo_mcore.train", "--config", "configs/tiny_cpu.yaml", "--output-dir", str(out),
            *_toy_overrides(toy), "rollout.mode=async", "reward.norm=group", "train.export_hf=false",
            "train.save_every=1"]
    proc = subprocess.Popen([*args, "train.steps=50"], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not ((out / "metrics.jsonl").is_file() and len((out / "metrics.jsonl").read_text().splitlines()) >= 3):
            assert proc.poll() is None and time.monotonic() < deadline, "the run did not reach step 3"
            time.sleep(0.5)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    saved = int((out / "checkpoints" / "latest").read_text().strip().removeprefix("step_"))
    _train(out, [*_toy_overrides(toy), "rollout.mode=async", "reward.norm=group", "train.export_hf=false",
                 "train.save_every=1", f"train.steps={saved + 2}"], extra=["--resume"])
    rows = _metrics(out)
    assert [r["step"] for r in rows] == list(range(1, saved + 3))  # steps after the checkpoint trained again
    assert all(r["staleness_max"] <= 1 for r in rows)
