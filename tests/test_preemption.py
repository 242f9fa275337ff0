"""Operating a run: Slurm's time-limit warning (SIGUSR1) mid-run saves the last completed step
although `train.save_every` is 0, a resume that would change the run is refused in one line, and
one that changes the learning rate applies it and says so, the LR schedule continuing exactly
where it stopped. Two trainer ranks under gspo_mcore.run.torchrun, as the launch scripts run them."""

import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from helpers import REPO, captured, descendants, kill_and_reap, metrics, reaped, start, toy_overrides, wait_for_rows

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("train")]

STEPS, WARMUP, LR, MIN_LR = 6, 2, 1e-3, 1e-4


def _schedule(step: int, lr: float) -> float:
    """Megatron's OptimizerParamScheduler, linear warmup then cosine to MIN_LR at STEPS."""
    if step <= WARMUP:
        return lr * step / WARMUP
    return MIN_LR + 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / (STEPS - WARMUP))) * (lr - MIN_LR)


def _command(out, overrides, nproc=2, resume=False):
    launcher = ["-m", "gspo_mcore.run.torchrun", "--standalone", "--nproc_per_node", str(nproc)] if nproc > 1 else []
    return [sys.executable, *launcher, "-m", "gspo_mcore.train", "--config", "configs/tiny_cpu.yaml",
            "--output-dir", str(out), *(["--resume"] if resume else []), *overrides]


def test_a_time_limit_signal_saves_the_last_step_and_a_resume_continues_the_schedule(toy, server, tmp_path):
    """The first run starts its own server and reward workers: none is left once it stopped."""

    out = tmp_path / "run"
    overrides = [*toy_overrides(toy), f"train.steps={STEPS}", "train.save_every=0", "reward.workers=2",
                 "train.export_hf=false", "weight_sync.check_every=0", f"optimizer.lr={LR}",
                 f"optimizer.lr_warmup_steps={WARMUP}", "optimizer.lr_decay=cosine", f"optimizer.min_lr={MIN_LR}"]
    with reaped(start(_command(out, overrides), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                      start_new_session=True)) as proc:
        wait_for_rows(proc, out, 2)
        children = descendants(proc)
        assert len(children) >= 5  # two ranks, the server and its workers, the reward workers
        output = kill_and_reap(proc, signal.SIGUSR1, children=children, timeout_s=300)  # torchrun passes it on
    overrides.append(f"rollout.urls=[{server}]")  # the resumed runs: the module's server (an applied change)
    saved = int((out / "checkpoints" / "latest").read_text().strip().removeprefix("step_"))
    assert 2 <= saved < STEPS and proc.returncode != 0, output[-3000:]
    assert f"stopped by SIGUSR1 after step {saved} (checkpoints/step_{saved:06d}): --resume continues" in output
    assert [r["step"] for r in metrics(out)] == list(range(1, saved + 1))
    assert "config.yaml" in os.listdir(out) and "git " in (out / "config.yaml").read_text().splitlines()[0]

    # A resume that would change the data or the model: refused, naming the fields, nothing started.
    refused = captured(_command(out, [*overrides, "train.group_size=4", "loss.function=grpo"], nproc=1, resume=True),
                       timeout=300)
    assert refused.returncode == 2
    last = refused.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --resume: loss.function ('gspo' -> 'grpo'), train.group_size (8 -> 4) differ from")

    # A new learning rate: applied from the restored step on, said in one line.
    new_lr = 2 * LR
    resumed = captured(_command(out, [*overrides, f"optimizer.lr={new_lr}"], resume=True))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resume: applying optimizer.lr {LR!r} -> {new_lr!r}" in resumed.stdout
    assert f"resumed from checkpoints/step_{saved:06d} (step {saved} of {STEPS})" in resumed.stdout
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:  # steps without a group with signal train nothing and report no lr
        if r["lr"] is not None:
            expected = _schedule(r["step"], LR if r["step"] <= saved else new_lr)
            assert r["lr"] == pytest.approx(expected, rel=1e-9), (r["step"], saved)
    assert sum(r["lr"] is not None for r in rows[saved:]) >= 2


def _lines_until_step(proc, step: int, deadline_s: float = 400) -> list[str]:
    """The run's output up to its progress line of `step` (then the caller signals it)."""
    lines, deadline = [], time.monotonic() + deadline_s
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(f"step {step:>4}/"):
            return lines
        assert time.monotonic() < deadline, "".join(lines[-20:])
    raise AssertionError(f"the run ended before step {step}:\n" + "".join(lines[-40:]))


STOP_LINES = ("SIGINT: saving the last completed step, then stopping (SIGINT again: stop at once)",
              "SIGINT: stopping now", "stopped by SIGINT after step ")


def test_ctrl_c_to_make_demos_process_group_saves_and_leaves_nothing_behind(tmp_path):
    """What a terminal does: SIGINT to every process of `make demo` (make, the demo, the trainer,
    its reward worker). The trainer saves the last completed step and says so in one line, make
    adds its own "Interrupt" line, nothing else speaks (reward workers, the demo's subprocess.run
    used to: tracebacks, and the trainer killed 0.25 s into its save). Nothing is left: no process,
    nothing in the run's TMPDIR (SGLang's IPC files and wandb's directories went to /tmp), no
    load-snapshot file of SGLang's in /dev/shm."""
    import psutil

    tmp, out = tmp_path / "tmp", tmp_path / "demo"
    tmp.mkdir()
    shm_before = {p for p in os.listdir("/dev/shm") if p.startswith("sglang")}
    # As a user's shell runs it: not a sub-make of the `make test` running this suite (its MAKELEVEL
    # would make the line `make[1]: ...`, and its MAKEFLAGS carry its jobserver).
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    env.update(TMPDIR=str(tmp), PYTHONWARNINGS="ignore")
    # As a terminal starts it: SIGINT at its default. A suite started in the background (`cmd &`
    # in a script) inherits SIGINT ignored, and make keeps an ignored SIGINT ignored (it exited 2).
    proc = subprocess.Popen(["make", "-s", "-o", ".venv/.installed", "demo", f"DEMO_ARGS=--output-dir {out}"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        _lines_until_step(proc, 2)
        children = psutil.Process(proc.pid).children(recursive=True)
        began = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        output, _ = proc.communicate(timeout=120)
        took = time.monotonic() - began
        _, alive = psutil.wait_procs(children, timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == -signal.SIGINT, output[-3000:]  # make re-raises it: the shell's $? is 130
    assert not alive, [(p.pid, p.name()) for p in alive]
    run = out / "tiny_cpu"
    saved = int((run / "checkpoints" / "latest").read_text().strip().removeprefix("step_"))
    said = [line for line in output.splitlines() if not line.startswith("step ")]
    assert said[:2] == [STOP_LINES[0], f"{STOP_LINES[2]}{saved} (checkpoints/step_{saved:06d}): --resume continues"]
    # make's own line, by its convention
    assert len(said) == 3 and re.fullmatch(r"make: \*\*\* \[Makefile:\d+: demo\] (Interrupt|Error 130)", said[2]), output
    assert [r["step"] for r in metrics(run)] == list(range(1, saved + 1)) and took < 60
    # torch's compile cache (tempfile.gettempdir()/torchinductor_USER) is every torch process's, made at import
    assert [p.name for p in tmp.iterdir() if not p.name.startswith("torchinductor_")] == []
    assert {p for p in os.listdir("/dev/shm") if p.startswith("sglang")} <= shm_before


def test_a_second_ctrl_c_during_the_save_stops_at_once_and_deletes_nothing_written(toy, server, tmp_path):
    """Two Ctrl-C to the trainer's process group 0.3 s apart, the second during the save of the
    first: one line each, exit 130 at once; no EOFError (Megatron's writer Manager, spawned at the
    first save, died of the Ctrl-C), and the metrics, eval and config of the completed steps stay."""
    out = tmp_path / "run"
    overrides = [*toy_overrides(toy, evaluate=True), f"rollout.urls=[{server}]", "train.save_every=0",
                 "reward.workers=2", "train.export_hf=false"]
    with reaped(start(_command(out, overrides, nproc=1), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                      start_new_session=True)) as proc:
        _lines_until_step(proc, 2)
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.3)
        began = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        output, _ = proc.communicate(timeout=60)
        took = time.monotonic() - began
    assert proc.returncode == 130 and took < 15, (took, output[-3000:])
    said = [line for line in output.splitlines() if not line.startswith("step ")]
    assert said[0] == STOP_LINES[0] and STOP_LINES[1] in said, output[-3000:]
    assert len(said) <= 3 and all(line.startswith(STOP_LINES) for line in said), output[-3000:]
    steps = [r["step"] for r in metrics(out)]
    assert steps[:2] == [1, 2] and steps == list(range(1, len(steps) + 1))
    assert (out / "config.yaml").is_file() and (out / "eval.jsonl").read_text().strip()
