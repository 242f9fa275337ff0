"""The GSPO trainer end to end: the real Megatron-Core model, a real SGLang server on CPU
started and stopped by the run, weights pushed after every step."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from conftest import REPO, run_module
from helpers import captured, metrics, toy_overrides, train, train_command
from gspo_mcore.metrics.schema import BY_NAME

# Slow: starts torchrun and SGLang servers. One xdist group: the module's server and default
# run are made once (`make test` runs two workers, --dist loadgroup).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("train")]

# Every row of the metric schema in every step (the sync check's on its steps), nothing else.
SYNC_CHECK = {name for name in BY_NAME if name.startswith("sync_check")}


@pytest.fixture(scope="session")
def default_run(toy, tmp_path_factory):
    """The CPU default exactly as shipped (configs/tiny_cpu.yaml), on this test's copy of the toy task."""
    out = tmp_path_factory.mktemp("default_run")
    start = time.monotonic()
    train(out, [*toy_overrides(toy, evaluate=True), "train.log_samples_every=20"])
    return out, time.monotonic() - start


def test_cpu_default_learns_within_ten_minutes(default_run):
    out, seconds = default_run
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 41))
    first = sum(r["reward_mean"] for r in rows[:10]) / 10
    last = sum(r["reward_mean"] for r in rows[-10:]) / 10
    assert last - first >= 0.3, (first, last)
    assert seconds < 600


def test_the_default_run_evaluates_held_out_prompts_and_writes_samples(default_run):
    """Before training, every 10 steps and at the end, on the version just pushed: held-out
    accuracy rises with the training reward, pass@k >= mean@k, and the steps evaluated carry the
    figures in their rows."""
    out, _ = default_run
    evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [(e["step"], e["version"]) for e in evals] == [(s, f"step-{s}") for s in (0, 10, 20, 30, 40)]
    assert evals[-1]["eval/toy/mean@4"] - evals[0]["eval/toy/mean@4"] >= 0.3, evals
    for e in evals:
        assert e["eval/toy/pass@4"] >= e["eval/toy/pass@1"] >= 0 and e["eval/toy/response_length"] > 0
        assert e["eval/toy/pass@1"] == pytest.approx(e["eval/toy/mean@4"])  # a 0/1 reward: pass@1 is the mean
    rows = {r["step"]: r for r in metrics(out)}
    assert rows[20]["eval/toy/mean@4"] == evals[2]["eval/toy/mean@4"] and "eval/toy/mean@4" not in rows[21]
    samples = [json.loads(line) for line in (out / "samples" / "step_000020.jsonl").read_text().splitlines()]
    assert len([s for s in samples if "eval" not in s]) == 8 and any(s.get("eval") == "toy" for s in samples)
    assert all(isinstance(s["response"], str) and s["reward"] in (0.0, 1.0) for s in samples)


def test_metrics_every_step_and_tensorboard(default_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _ = default_run
    rows = metrics(out)
    assert sum(r["clip_fraction"] is not None for r in rows) >= 30
    for row in rows:
        keys = {k for k in row if not k.startswith("eval/")}  # the evaluated steps' (eval.jsonl test)
        assert keys - SYNC_CHECK == set(BY_NAME) - SYNC_CHECK, keys ^ set(BY_NAME)
        assert 0 <= row["reward_mean"] <= 1
        if row["clip_fraction"] is None:  # every group had equal rewards: nothing to train on
            assert row["groups_kept"] == 0 and row["grad_norm"] is None
            continue
        assert 0 <= row["clip_fraction"] <= 1
        assert len(row["router_max_over_mean_load"]) == 4  # one per MoE layer
        # float32 engine and trainer: the on-policy log-ratio is numerical noise only.
        assert row["mismatch_abs_log_ratio_max"] < 1e-4
    checks = [r for r in rows if "sync_check_median" in r]  # check_every: 10
    assert [r["step"] for r in checks] == [10, 20, 30, 40]
    assert all(r["sync_check_median"] < 1e-4 for r in checks)
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("reward_mean")] == list(range(1, 41))
    assert [e.value for e in events.Scalars("clip_fraction")] == pytest.approx(
        [r["clip_fraction"] for r in rows if r["clip_fraction"] is not None])
    assert "router_max_over_mean_load/layer_3" in events.Tags()["scalars"]
    assert [e.step for e in events.Scalars("eval/toy/mean@4")] == [0, 10, 20, 30, 40]


def test_checkpoints_and_final_hf_export(default_run, toy):
    from safetensors.torch import load_file

    out, _ = default_run
    ckpt = out / "checkpoints"
    assert (ckpt / "latest").read_text() == "step_000040"
    assert (ckpt / "step_000020" / "trainer_state.json").is_file()
    assert not list(ckpt.glob("*.tmp*"))
    state = json.loads((ckpt / "step_000040" / "trainer_state.json").read_text())
    assert state["step"] == 40 and state["rollout"]["sampler"]["position"] > 0
    trained = load_file(out / "hf" / "model-00001-of-00001.safetensors")
    initial = load_file(toy / "model" / "model.safetensors")
    assert trained.keys() == initial.keys()
    assert any(not torch.equal(trained[k], initial[k]) for k in trained)
    assert (out / "hf" / "tokenizer.json").is_file()


def test_plots_for_one_run_and_an_overlay(default_run, tmp_path):
    out, _ = default_run
    proc = subprocess.run([sys.executable, "-m", "gspo_mcore.run.plot", str(out), str(out), "--labels", "GSPO,again",
                           "--out", str(tmp_path / "plots")], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    for name in ("reward", "clip_fraction", "response_length", "mismatch", "step_time", "reward_wallclock"):
        png = tmp_path / "plots" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    proc = subprocess.run([sys.executable, "-m", "gspo_mcore.run.plot", str(tmp_path)], capture_output=True,
                          text=True, cwd=REPO)
    assert proc.returncode == 2 and proc.stderr.strip() == f"error: {tmp_path / 'metrics.jsonl'}: no metrics (is {tmp_path} a run's output directory?)"


def test_expert_parallel_run_with_recompute_disk_sync_and_checks(toy, server, tmp_path):
    """2 ranks, EP=2 (experts split, dense layers data-parallel), started from the converter's
    torch_dist output: the old log-probs recomputed
    by the trainer make the on-policy ratio 1 up to float noise; weights go through the disk
    path and the colocated release/resume; the engine is checked against the trainer every step."""
    out = tmp_path / "ep2"
    # Initial weights from a torch_dist checkpoint made by the converter (model.mcore_dir).
    mcore = tmp_path / "mcore"
    run_module(["-m", "checkpoint_convert", "hf-to-mcore", "--hf-dir", str(toy / "model"), "--output-dir", str(mcore)])
    train(out, [*toy_overrides(toy), f"model.mcore_dir={mcore}", f"rollout.urls=[{server}]", "distributed.expert_parallel=2", "train.steps=3",
                 "train.recompute_old_logprobs=true", "weight_sync.method=disk", "weight_sync.colocate=true",
                 "weight_sync.check_every=1", "train.save_every=1", "train.keep_checkpoints=2",
                 "train.export_hf=false"], nproc=2)
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    # Retention: the newest two complete checkpoints stay, `latest` names the newest.
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_000002", "step_000003"]
    assert (out / "checkpoints" / "latest").read_text() == "step_000003"
    for row in rows:
        assert row["mismatch_abs_log_ratio_max"] < 1e-5
        assert row["sync_check_median"] < 1e-4
    assert (out / "weights_sync" / "model.safetensors.index.json").is_file()


def _checkpoint_entries(path) -> dict:
    """Every entry of a torch_dist checkpoint, without a process group."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    return _load_state_dict_from_keys(checkpoint_id=str(path))


def test_resume_restores_the_exact_state_and_continues_the_data(default_run, toy, server, tmp_path):
    """A run of 2 steps resumed to 4 continues the data where it stopped (the position is in the
    checkpoint), and a resume with no step left is one line that leaves the checkpoint as it was
    (it re-saved the same state after starting the engine for nothing). The restored model,
    optimizer and RNG state show in what the resume trains: with every request seeded (gspo_mcore.common.seeds; the CPU
    server's seeded sampler, sglang_cpu/shim/gspo_sglang_seeds.py), the run and its resume
    sample what the default run of the same seed did: the same reward, step by step. The first run and the resume that trains print no upstream warning
    (Python's own display, as a user runs them): four or five on every run (Megatron's "full
    scope is deprecated", a `.grad` one from the CPU bridge, two c10d FutureWarnings,
    `load_state_dict` is deprecated on resume) buried the one-line messages."""
    overrides = [*toy_overrides(toy), f"rollout.urls=[{server}]", "train.save_every=0", "train.export_hf=false", "weight_sync.check_every=0"]
    out = tmp_path / "run"
    _assert_no_upstream_warnings(train(out, [*overrides, "train.steps=2"], warnings=True))
    original = tmp_path / "step_000002.original"
    shutil.copytree(out / "checkpoints" / "step_000002", original)
    # Resume with nothing left to do: one line before anything starts (it started the engine, pushed
    # the weights and trained nothing), and the checkpoint left as it was.
    done = subprocess.run(train_command(out, ["--resume", *overrides, "train.steps=2"]), capture_output=True, text=True,
                          cwd=REPO, env={"PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}, timeout=300)
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1] == (
        f"error: {out}: finished at step 2 of train.steps 2; raise train.steps (e.g. --resume train.steps=4) to continue")
    before, after = _checkpoint_entries(original), _checkpoint_entries(out / "checkpoints" / "step_000002")
    assert before.keys() == after.keys() and any("exp_avg_sq" in key for key in before)
    for key in before:
        if isinstance(before[key], torch.Tensor):
            assert torch.equal(before[key], after[key]), key
    # A run killed after logging step 3 but before saving it: the resumed run trains step 3
    # again, and its rows replace the killed run's (metrics.jsonl and TensorBoard).
    with open(out / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 3, "reward_mean": -1.0}) + "\n")
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(out / "tensorboard")) as killed:
        killed.add_scalar("reward_mean", -1.0, 3)
    _assert_no_upstream_warnings(train(out, [*overrides, "train.steps=4"], extra=["--resume"], warnings=True))
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[2]["reward_mean"] >= 0
    # Its evaluation, checkpoints and server aside, the default run is this one: before per-request
    # seeds on the CPU server, two runs of one seed drew different responses from step 1.
    expected = [r["reward_mean"] for r in metrics(default_run[0])[:4]]
    assert [r["reward_mean"] for r in rows] == pytest.approx(expected, abs=1e-6)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value >= 0) for e in events.Scalars("reward_mean")] == [(s, True) for s in (1, 2, 3, 4)]
    # A new run into a directory that holds one is refused, naming the two ways on.
    proc = subprocess.run([sys.executable, "-m", "gspo_mcore.train", "--config", "configs/tiny_cpu.yaml",
                           "--output-dir", str(out), *overrides], capture_output=True, text=True, cwd=REPO,
                          env={"PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: {out}: holds a run already: --resume continues it, --overwrite replaces it")
    # The data position continues where the interrupted run stopped: 4 steps x 16 prompts in
    # the same (seeded) permutation, exactly what an uninterrupted run reaches.
    resumed_state = json.loads((out / "checkpoints" / "step_000004" / "trainer_state.json").read_text())
    assert resumed_state["step"] == 4
    assert resumed_state["rollout"]["sampler"] == {"epoch": 0, "position": 4 * 16, "seed": 1234, "num_samples": 1024}


def test_resume_without_a_checkpoint_and_bad_data_fail_fast_with_one_line(toy, tmp_path):
    env = {"PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "gspo_mcore.train", "--config", "configs/tiny_cpu.yaml", "--output-dir",
           str(tmp_path / "none"), *toy_overrides(toy)]
    proc = subprocess.run([*cmd, "--resume"], capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == f"error: {tmp_path / 'none' / 'checkpoints' / 'latest'}: no checkpoint to resume from"
    proc = subprocess.run([*cmd, f"data.path={tmp_path / 'missing.jsonl'}"], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == f"error: {tmp_path / 'missing.jsonl'}: dataset file not found"
    # with the user's own warning settings (no PYTHONWARNINGS): the error alone, exactly one line
    # (old: torch's TypedStorage deprecation, triggered by megatron through the CPU bridge, first)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x", "answer": "1"}\n{broken\n')
    proc = subprocess.run([*cmd, f"data.path={bad}"], capture_output=True, text=True, cwd=REPO,
                          env={"PYTHONPATH": str(REPO), "PATH": os.environ["PATH"]}, timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: {bad}:2: not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"]
    assert not (tmp_path / "none").exists()  # failed before any server started: no output directory
    proc = subprocess.run([*cmd, "reward.name=no_such_module:reward"], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=300)
    assert proc.returncode == 2 and "reward 'no_such_module:reward': cannot import" in proc.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "none").exists()


@pytest.mark.parametrize("layout", ["distributed.pipeline_parallel=2", "distributed.tensor_parallel=2"])
def test_pipeline_and_tensor_parallel_runs(toy, server, tmp_path, layout):
    """PP=2 (variable microbatch shapes through the pipeline) and TP=2 + sequence parallel
    (sequences padded to a multiple of TP): the update runs, the pushed weights pass the check."""
    out = tmp_path / "run"
    train(out, [*toy_overrides(toy), f"rollout.urls=[{server}]", layout, "train.steps=2",
                 "weight_sync.check_every=1", "train.save_every=0", "train.export_hf=false"], nproc=2)
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["sync_check_median"] < 1e-4 and r["mismatch_abs_log_ratio_max"] < 1e-4 for r in rows)
    assert json.loads((out / "summary.json").read_text())["steps"] == 2  # every run ends with its summary


def test_a_run_that_trains_nothing_still_saves(toy, server, tmp_path):
    """A reward that scores every response 0: no group has signal, no step trains, the optimizer
    has no state; the run still saves its final checkpoint and exits cleanly. (A reward that
    always raises stops the run: tests/test_rollout_source.py.)"""
    out = tmp_path / "run"
    train(out, [*toy_overrides(toy), f"rollout.urls=[{server}]", "reward.name=tests.reward_fixtures:zero_reward",
                 "train.steps=2", "train.save_every=0", "train.export_hf=false", "weight_sync.check_every=0"])
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["reward_errors"] == 0 and r["reward_mean"] == 0 and r["loss"] is None for r in rows)
    assert (out / "checkpoints" / "latest").read_text() == "step_000002"
    assert (out / "checkpoints" / "step_000002" / "trainer_state.json").is_file()


def test_gspo_eval_on_the_default_runs_exported_model(default_run, toy, server, tmp_path):
    """gspo-eval on the run's OUTPUT_DIR (its exported hf/), on a running server that loads it:
    the table and a JSON line, and the run's own last evaluation's figures (it printed 0.938 where
    the run said 0.969: its seeds hashed no weight version), said on stderr."""
    out, _ = default_run
    dataset = f"eval.datasets=[{{name: toy, path: {toy / 'eval.jsonl'}, samples: 4, max_new_tokens: 3}}]"
    proc = subprocess.run([sys.executable, "-m", "gspo_mcore.evaluation.cli", "--config", "configs/tiny_cpu.yaml",
                           "--model", str(out), "--urls", server, dataset], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"},
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("| dataset | prompts | k | mean@k ± s.e. |") and lines[2].startswith("| toy | 64 | 4 | ")
    figures = json.loads(lines[-1])
    last = json.loads((out / "eval.jsonl").read_text().splitlines()[-1])
    assert figures["model"] == str(out / "hf") and figures["eval/toy/pass@4"] >= figures["eval/toy/mean@4"]
    assert {k: v for k, v in figures.items() if k.startswith("eval/") and not k.endswith("time_s")} == {
        k: v for k, v in last.items() if k.startswith("eval/") and not k.endswith("time_s")}, (figures, last)
    assert f"seeds of the run's last evaluation of these weights: train.seed 1234, weights step-40" in proc.stderr
    # A run without hf/: its latest checkpoint is converted for the engine.
    bare = tmp_path / "bare"
    shutil.copytree(out / "checkpoints", bare / "checkpoints")
    proc = subprocess.run([sys.executable, "-m", "gspo_mcore.evaluation.cli", "--config", "configs/tiny_cpu.yaml",
                           "--model", str(bare), "--urls", server, dataset, f"model.hf_dir={toy / 'model'}"],
                          capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "converting the latest checkpoint" in proc.stderr
    converted = json.loads(proc.stdout.strip().splitlines()[-1])
    assert abs(converted["eval/toy/mean@4"] - last["eval/toy/mean@4"]) < 0.2, (converted, last)


def _assert_no_upstream_warnings(proc) -> None:
    for warned in ("full scope is deprecated", "not a leaf Tensor", "reduce_scatter_tensor", "all_gather_into_tensor",
                   "`load_state_dict` is deprecated"):
        assert warned not in proc.stderr, (warned, proc.stderr[-3000:])


def test_the_docs_multi_turn_example_runs_as_copied_on_the_demo_task(toy, server, tmp_path):
    """docs/03-multi-turn.md's ask_twice, copied into mypkg/rollouts.py: it ran 216 s and stopped
    with the engine's 400 (256 new tokens past the toy model's context), its follow-up question
    outside the toy vocabulary."""
    import re

    text = (REPO / "docs" / "03-multi-turn.md").read_text()
    code = next(block for block in re.findall(r"```python\n(.*?)```", text, re.S) if "async def ask_twice" in block)
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "rollouts.py").write_text(code)
    out = tmp_path / "run"
    proc = captured(train_command(out, [*toy_overrides(toy), f"rollout.urls=[{server}]",
                                        "rollout.function=mypkg.rollouts:ask_twice", "train.steps=2",
                                        "train.save_every=0", "train.save_final=false", "train.export_hf=false"]),
                    PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)]))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(out)
    assert [r["turns_mean"] for r in rows] == [2, 2] and all(0 < r["env_token_fraction"] < 1 for r in rows)
