"""The real `Trainer.run` loop driven with stand-ins for the learner, the engine, the weight sync,
the producer and the evaluator (the builder seam, gspo_mcore.run.trainer.build_parts), in one process
with a gloo group of one: the save cadence and its retention, the evaluation cadence, a signal in
a step's rollout and one in its update, a resume continuing the schedule and the data, the metric
rows (null where a figure is absent). The real checkpointer, metrics sinks and stop request run
as in a run; the slow tests (test_train.py, test_preemption.py) run the same loop with Megatron
and a server."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch.distributed as dist

from conftest import REPO

STEPS = 6
EMPTY_STEP = 3  # its batch has no group with signal: nothing trains
EVAL = "eval/toy/mean@4"


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    if not dist.is_initialized():
        store = tmp_path_factory.mktemp("store") / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def signal_handlers():
    """The run installs its handlers process-wide (gspo_mcore.run.preemption.StopRequest): restored after."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


class StandInLearner:
    """The update as a record of what trained: its state (the "weights") is the steps it trained on."""

    arch = None  # no model: on CPU the step's mfu / hfu are null without it

    def __init__(self, signal_in_update: tuple[int, int] | None = None):
        self.trained: list[int] = []
        self.stale: list = []  # each update's batch's stale marks
        self.lr_steps = 0
        self.signal_in_update = signal_in_update  # (step, signal): sent during that step's update
        self.scheduler = self

    def step(self, count: int) -> None:  # the LR scheduler's
        self.lr_steps += count

    def recompute_old_logprobs(self, rollouts) -> list[list[float]]:
        """The trainer's forward agreeing with the engine exactly (the CPU default checks it: Config.strict)."""
        return [list(r.logprobs) for r in rollouts]

    def minibatch_split(self, count: int, step: int) -> list[list[int]]:
        return [list(range(count))]

    def update(self, batch, step: int, old_logprobs=None) -> dict:
        assert batch.minibatches == [list(range(len(batch.rollouts)))]  # the split the trainer made
        if self.signal_in_update and self.signal_in_update[0] == step:
            os.kill(os.getpid(), self.signal_in_update[1])
        self.trained.append(step)
        self.stale.append(batch.stale)
        return {"loss": -sum(batch.advantages) / len(batch.advantages), "grad_norm": 1.0, "lr": 1e-3,
                "minibatches": len(batch.minibatches)}

    def state_dict(self) -> list[int]:
        return list(self.trained)

    def load_state_dict(self, trained: list[int]) -> None:
        self.trained = list(trained)


class StandInProducer:
    """Batches drawn in order from a data position that a checkpoint holds; batch EMPTY_STEP has
    no group with signal. `signal_in_rollout`: (step, signal) sent while that step's batch is drawn."""

    def __init__(self, signal_in_rollout: tuple[int, int] | None = None, overlapped: bool = False):
        self.overlapped = overlapped  # generated beside training: its tokens from this step's weights and the last's
        self.position = 0  # batches drawn and handed over
        self.drawn: list[int] = []  # the data position of each batch handed over
        self.started_at: int | None = None
        self.signal_in_rollout = signal_in_rollout
        self.pauses = 0

    def start(self, version: int) -> None:
        self.started_at = version

    def get_batch(self, step: int):
        from gspo_mcore.batch.rollout import Batch, Rollout

        assert self.started_at is not None, "a batch asked for before start()"
        if self.signal_in_rollout and self.signal_in_rollout[0] == step:
            os.kill(os.getpid(), self.signal_in_rollout[1])  # the handler abandons the rollout here
        kept = 0 if self.position + 1 == EMPTY_STEP else 2
        versions = (max(0, step - 1), step, step) if self.overlapped else ()
        rollouts = [Rollout([1, 2], [3, 4, 5], [-0.1] * 3, "stop", f"step-{step}", reward=1.0 * (i % 2),
                            token_versions=versions) for i in range(2 * kept)]
        metrics = {"reward_mean": 0.5 if kept else 0.0, "groups_kept": kept, "groups_total": 2,
                   "tokens_generated": 12, "trainer_wait_s": 0.001 if self.overlapped else 0.0}
        self.drawn.append(self.position)
        self.position += 1
        if self.overlapped:
            return Batch.spanning(rollouts, [1.0, -1.0] * kept, metrics, step)
        return Batch(rollouts, [1.0, -1.0] * kept, metrics)

    def pause(self) -> None:
        self.pauses += 1

    def resume(self, version: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]

    def close(self) -> None:
        pass


class StandInEvaluator:
    def __init__(self):
        self.versions: list[str] = []
        self.last_samples = [{"eval": "toy", "response": "animal_1"}]

    def run(self, client, version: str) -> dict:
        self.versions.append(version)
        # A share that is 0 is not said on the eval line; one that is not, is.
        return {EVAL: 0.25 + 0.01 * len(self.versions), "eval/toy/truncated_fraction": 0.0,
                "eval/toy/no_program_fraction": 0.125 * (len(self.versions) == 2)}


class StandInEngine:
    urls = ["http://stand-in:1"]


class StandInSync:
    def __init__(self):
        self.pushed: list[str] = []

    def push(self, version: str) -> None:
        self.pushed.append(version)

    def close(self) -> None:
        pass


class StandIns:
    """One run's stand-ins and the builder that hands them to the Trainer."""

    def __init__(self, signal_in_rollout=None, signal_in_update=None, overlapped=False):
        self.learner = StandInLearner(signal_in_update)
        self.producer = StandInProducer(signal_in_rollout, overlapped)
        self.evaluator = StandInEvaluator()
        self.sync = StandInSync()
        self.saved: list[int] = []  # the steps of each checkpoint save, in order

    def build(self, config, output_dir, *, resume, overwrite, stop, stack):
        from types import SimpleNamespace

        from gspo_mcore.megatron.checkpointing import Checkpointer
        from gspo_mcore.run.trainer import RankZero, TrainerParts

        class Counted(Checkpointer):
            def save(inner, step: int):
                self.saved.append(step)
                return super().save(step)

        checkpoints = Counted(output_dir, None, keep=config.train.keep_checkpoints)
        checkpoints.register("model", self.learner)
        checkpoints.register("rollout", self.producer)
        stack.callback(self.producer.close)
        source = SimpleNamespace(client=None, tokenizer=SimpleNamespace(
            decode=lambda ids, skip_special_tokens: " ".join(map(str, ids))))
        host = RankZero(config, output_dir, source, self.producer, self.evaluator, StandInEngine(), stop, stack)
        return TrainerParts(self.learner, StandInEngine(), self.sync, host, checkpoints)


def _config(tmp_path, *overrides):
    from gspo_mcore.config import load_config

    dataset = f"[{{name: toy, path: {tmp_path / 'eval.jsonl'}, samples: 4, max_new_tokens: 3}}]"
    return load_config(REPO / "configs" / "tiny_cpu.yaml", [
        f"train.steps={STEPS}", "train.export_hf=false", "weight_sync.check_every=0", "train.log_samples_every=2",
        "train.log_samples=2", f"eval.datasets={dataset}", "eval.every=2", *overrides])


def _run(config, out, stand_ins, resume=False) -> int | None:
    """The loop to its end (None) or to the exit code a signal stopped it with."""
    from gspo_mcore.run.trainer import Trainer

    try:
        Trainer(config, out, resume=resume, build=stand_ins.build).run()
    except SystemExit as stop:
        return stop.code
    return None


def _rows(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _checkpoints(out) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").glob("step_*"))


def test_the_loop_saves_evaluates_and_logs_on_its_cadences(one_rank, signal_handlers, tmp_path, capsys):
    from gspo_mcore.metrics.schema import ASYNC_METRICS, UPDATE

    out, stand_ins = tmp_path / "run", StandIns()
    assert _run(_config(tmp_path, "train.save_every=2", "train.keep_checkpoints=2"), out, stand_ins) is None
    # Every 2 steps and at the end (the final one: not twice); the newest 2 kept.
    assert stand_ins.saved == [2, 4, 6] and _checkpoints(out) == ["step_000004", "step_000006"]
    assert (out / "checkpoints" / "latest").read_text() == "step_000006"
    assert json.loads((out / "checkpoints" / "step_000004" / "trainer_state.json").read_text()) == {
        "step": 4, "model": [0, 1, 3], "rollout": {"position": 4}}
    # The engine gets the trainer's weights first, then every step's; evaluated before training,
    # every 2 steps and at the end, each time on the weights just pushed.
    assert stand_ins.sync.pushed == [f"step-{k}" for k in range(STEPS + 1)]
    assert stand_ins.evaluator.versions == ["step-0", "step-2", "step-4", "step-6"]
    evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [(e["step"], e["version"]) for e in evals] == [(0, "step-0"), (2, "step-2"), (4, "step-4"), (6, "step-6")]

    rows = _rows(out)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["step"] for r in rows if EVAL in r] == [2, 4, 6]
    assert rows[3][EVAL] == evals[2][EVAL]
    # One layout for every row: a figure absent in a step is null, not missing.
    keys = {k for k in rows[0] if not k.startswith("eval/")}
    assert all({k for k in r if not k.startswith("eval/")} == keys for r in rows)
    assert set(UPDATE) | set(ASYNC_METRICS) <= keys
    empty = rows[EMPTY_STEP - 1]
    assert empty["samples"] == 0 and all(empty[k] is None for k in UPDATE)
    assert all(r["loss"] is not None for r in rows if r["step"] != EMPTY_STEP)
    # A synchronous batch: no staleness, no trainer wait, no pause figure.
    assert all(r[k] is None for r in rows for k in ASYNC_METRICS) and all(r["engine_pause_s"] is None for r in rows)
    assert stand_ins.learner.trained == [0, 1, 3, 4, 5] and stand_ins.learner.lr_steps == STEPS
    samples = sorted(p.name for p in (out / "samples").iterdir())
    assert samples == ["step_000002.jsonl", "step_000004.jsonl", "step_000006.jsonl"]
    written = [json.loads(line) for line in (out / "samples" / "step_000002.jsonl").read_text().splitlines()]
    assert [w.get("eval") for w in written] == [None, None, "toy"] and written[0]["response"] == "3 4 5"
    assert [w.get("advantage") for w in written] == [1.0, -1.0, None]  # each training response's
    printed = capsys.readouterr().out.splitlines()
    assert [line.split(" [")[0] for line in printed if line.startswith("step ")] == [
        f"step {k:>4}/{STEPS}" for k in range(1, STEPS + 1)]
    said = [line for line in printed if line.startswith("eval of ")]
    assert said[1].endswith(f"{EVAL} 0.270, eval/toy/no_program_fraction 12%") and said[0].endswith(f"{EVAL} 0.260")


def test_a_batch_generated_beside_training_reports_the_wait_and_the_pause(one_rank, signal_handlers, tmp_path):
    """Asynchronous modes' rows: the trainer's wait and idle fraction and the engine's pause around
    the push are figures of the step (null in a synchronous run, the test above); the update
    sees the batch's stale marks."""
    out, stand_ins = tmp_path / "run", StandIns(overlapped=True)
    assert _run(_config(tmp_path, "train.save_every=0", "train.steps=2"), out, stand_ins) is None
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2] and stand_ins.producer.pauses == 2
    assert all(r["trainer_wait_s"] == 0.001 for r in rows)
    assert all(r["trainer_idle_fraction"] == pytest.approx(0.001 / r["time_step_s"]) for r in rows)
    assert all(r["engine_pause_s"] is not None and r["engine_pause_s"] >= 0 for r in rows)
    assert stand_ins.learner.stale == [[[0.0, 0.0, 0.0]] * 4, [[1.0, 0.0, 0.0]] * 4]


def test_a_signal_in_a_rollout_saves_the_last_step_and_a_resume_continues(one_rank, signal_handlers, tmp_path, capsys):
    """SIGUSR1 while step 4's batch is drawn: it is abandoned, step 3 saved (save_every says
    nothing then), exit 138. The resume draws that batch again, keeps the save cadence (step 4,
    not 3 + 2) and logs each step once; no evaluation of the restored weights is repeated."""
    config, out = _config(tmp_path, "train.save_every=4"), tmp_path / "run"
    first = StandIns(signal_in_rollout=(3, signal.SIGUSR1))
    assert _run(config, out, first) == 128 + signal.SIGUSR1
    err = capsys.readouterr().err
    assert "stopped by SIGUSR1 after step 3 (checkpoints/step_000003): --resume continues" in err
    assert first.saved == [3] and _checkpoints(out) == ["step_000003"]
    assert [r["step"] for r in _rows(out)] == [1, 2, 3]
    assert first.producer.position == 3 and first.learner.trained == [0, 1]

    resumed = StandIns()
    assert _run(config, out, resumed, resume=True) is None
    assert "resumed from checkpoints/step_000003 (step 3 of 6)" in capsys.readouterr().out
    assert resumed.producer.started_at == 3 and resumed.producer.drawn == [3, 4, 5]
    assert resumed.learner.trained == [0, 1, 3, 4, 5]  # restored, then steps 4..6
    assert resumed.sync.pushed == ["step-3", "step-4", "step-5", "step-6"]
    assert resumed.saved == [4, 6] and _checkpoints(out) == ["step_000003", "step_000004", "step_000006"]
    assert [r["step"] for r in _rows(out)] == list(range(1, STEPS + 1))
    evals = [json.loads(line)["step"] for line in (out / "eval.jsonl").read_text().splitlines()]
    assert evals == [0, 2, 4, 6]


def test_a_signal_in_an_update_finishes_the_step_and_saves_it_once(one_rank, signal_handlers, tmp_path, capsys):
    """SIGTERM during step 2's update: the step completes (pushed, logged), its cadence checkpoint is
    the one the stop names, exit 143."""
    out, stand_ins = tmp_path / "run", StandIns(signal_in_update=(1, signal.SIGTERM))
    assert _run(_config(tmp_path, "train.save_every=2"), out, stand_ins) == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    assert "SIGTERM: saving the last completed step, then stopping" in err
    assert "stopped by SIGTERM after step 2 (checkpoints/step_000002): --resume continues" in err
    assert stand_ins.saved == [2] and _checkpoints(out) == ["step_000002"]
    assert [r["step"] for r in _rows(out)] == [1, 2]
    assert stand_ins.sync.pushed == ["step-0", "step-1", "step-2"] and stand_ins.learner.trained == [0, 1]


def test_a_signal_before_any_step_completes_saves_nothing(one_rank, signal_handlers, tmp_path, capsys):
    out = tmp_path / "run"
    assert _run(_config(tmp_path, "train.save_every=0"), out, StandIns(signal_in_rollout=(0, signal.SIGUSR1))) == 138
    assert "stopped by SIGUSR1 before a step completed: no checkpoint yet" in capsys.readouterr().err
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").read_text()


def test_the_other_ranks_twin_has_every_method_rank_zero_has():
    """The step calls `host.X` on every rank: OtherRank must answer each of RankZero's."""
    from gspo_mcore.run.trainer import OtherRank, RankZero

    public = {name for name in vars(RankZero) if not name.startswith("_")} - {"evaluate"}
    assert public <= set(vars(OtherRank)), public - set(vars(OtherRank))


@pytest.mark.slow
def test_python_m_gspo_mcore_train_executes_the_module_once(tmp_path):
    """`python -m` runs train.py as __main__; a run then imports the trainer by name. When both lived
    in train.py, its code ran twice (counted here by the interpreter's `exec` audit events)."""
    driver = (
        "import runpy, sys\n"
        "ran = []\n"
        "sys.addaudithook(lambda event, args: ran.append(1) if event == 'exec' and args[0].co_name == '<module>'"
        " and args[0].co_filename.endswith('gspo_mcore/train.py') else None)\n"
        "sys.argv[0] = 'gspo_mcore.train'\n"
        "try:\n"
        "    runpy.run_module('gspo_mcore.train', run_name='__main__', alter_sys=True)\n"
        "finally:\n"
        "    print('train.py executed', len(ran), file=sys.stderr)\n")
    # A run that gets as far as the trainer's module (gspo_mcore.run.start), then stops on its input.
    proc = subprocess.run([sys.executable, "-c", driver, "--config", "configs/tiny_cpu.yaml", "--output-dir",
                           str(tmp_path / "run"), f"data.path={tmp_path / 'missing.jsonl'}"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and lines[-2].startswith("error: "), proc.stderr[-2000:]
    assert lines[-1] == "train.py executed 1"


def test_a_colocated_step_holds_the_gradient_buffers_only_while_the_engine_is_released(one_rank, signal_handlers,
                                                                                        tmp_path):
    """#47 item 5, optimizer.offload_grad_buffers: once the colocated engine has released its
    memory the learner takes its gradient buffers back, before the update; it gives them back
    before the engine resumes (its KV cache comes back into their room). Without the switch,
    neither call."""
    calls = []

    class Learner(StandInLearner):
        def restore_grad_buffers(self):
            calls.append("restore grads")

        def offload_grad_buffers(self):
            calls.append("offload grads")

        def update(self, batch, step, old_logprobs=None):
            calls.append("update")
            return super().update(batch, step, old_logprobs)

    class Engine(StandInEngine):
        def release_memory(self):
            calls.append("engine released")

        def resume_memory(self):
            calls.append("engine resumed")

    class Colocated(StandIns):
        def build(self, *args, **kwargs):
            parts = super().build(*args, **kwargs)
            parts.host.engine = Engine()
            return parts

    for switch, step in ((True, ["engine released", "restore grads", "update", "offload grads", "engine resumed"]),
                         (False, ["engine released", "update", "engine resumed"])):
        calls.clear()
        stand_ins = Colocated()
        stand_ins.learner = Learner()
        config = _config(tmp_path, "train.save_every=0", "train.steps=2", "weight_sync.colocate=true",
                         f"optimizer.offload_grad_buffers={str(switch).lower()}")
        assert _run(config, tmp_path / f"run_{switch}", stand_ins) is None
        assert calls == step * 2, switch
