"""Operating a run, the pure parts: what a --resume may change (gspo_mcore.run_config), the LR
schedule over training steps (gspo_mcore.optimizer.lr_scheduler), torchrun's signal defaults."""

import math

import pytest
import torch

from gspo_mcore.config import ConfigError, load_config
from gspo_mcore.run_config import check_resume, save


def test_a_resume_applies_the_lr_and_the_step_count_and_refuses_the_rest(tmp_path):
    base = ["train.steps=10"]
    path = save(load_config("configs/tiny_cpu.yaml", base), tmp_path)
    assert path.read_text().startswith("# The resolved config of this run (gspo-mcore ")
    assert check_resume(load_config("configs/tiny_cpu.yaml", base), tmp_path) is None
    said = check_resume(load_config("configs/tiny_cpu.yaml", [*base, "optimizer.lr=0.01", "train.steps=20"]), tmp_path)
    assert said == "resume: applying optimizer.lr 0.001 -> 0.01, train.steps 10 -> 20"
    with pytest.raises(ConfigError, match=r"^--resume: rollout.temperature \(1.0 -> 0.7\), train.group_size \(8 -> 4\) "
                                          r"differ from .*config.yaml: they change the model or the data order"):
        check_resume(load_config("configs/tiny_cpu.yaml", [*base, "train.group_size=4", "rollout.temperature=0.7",
                                                           "optimizer.lr=0.01"]), tmp_path)
    assert check_resume(load_config("configs/tiny_cpu.yaml"), tmp_path / "none") is None  # nothing saved: nothing to say


def test_the_saved_config_loads_again_as_a_config(tmp_path):
    config = load_config("configs/tiny_cpu.yaml", ["loss.token_mask_band=[0.5, 2.0]"])
    again = load_config(save(config, tmp_path))
    assert again == config


def test_the_lr_schedule_warms_up_then_decays_over_training_steps():
    from gspo_mcore.config import OptimizerConfig
    from gspo_mcore.optimizer import lr_scheduler

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    for group in optimizer.param_groups:  # as Megatron's param groups carry them
        group["max_lr"], group["min_lr"] = 1e-3, 1e-4
    cfg = OptimizerConfig(lr=1e-3, lr_warmup_steps=2, lr_decay="cosine", min_lr=1e-4)
    scheduler = lr_scheduler(optimizer, cfg, total_steps=6)
    seen = []
    for _ in range(6):
        scheduler.step(1)  # before each training step's update
        seen.append(optimizer.param_groups[0]["lr"])
    expected = [5e-4, 1e-3] + [1e-4 + 0.5 * (1 + math.cos(math.pi * k / 4)) * 9e-4 for k in (1, 2, 3, 4)]
    assert seen == pytest.approx(expected, rel=1e-12)
    constant = lr_scheduler(optimizer, OptimizerConfig(lr=1e-3), total_steps=6)
    constant.step(3)
    assert optimizer.param_groups[0]["lr"] == 1e-3


@pytest.mark.parametrize("override, message", [
    ("optimizer.min_lr=0.01", "optimizer.min_lr: 0.01 must be within [0, optimizer.lr]"),
    ("optimizer.lr_warmup_steps=40", "optimizer.lr_warmup_steps: 40 must be within [0, train.steps) (40)"),
])
def test_schedule_fields_are_checked(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        load_config("configs/tiny_cpu.yaml", [override])


def test_torchrun_passes_sigusr1_on_and_waits_for_the_save():
    from gspo_mcore.torchrun import with_signal_defaults

    argv = ["--standalone", "--nproc_per_node", "2", "-m", "gspo_mcore.train"]
    assert with_signal_defaults(argv, {}) == ["--signals-to-handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
                                              "--shutdown-timeout", "540", *argv]
    assert with_signal_defaults(argv, {"GSPO_SAVE_TIMEOUT_S": "900"})[3] == "900"
    given = ["--signals_to_handle=SIGTERM", "--shutdown-timeout", "60", *argv]
    assert with_signal_defaults(given, {}) == given


@pytest.fixture
def stop_request():
    """A StopRequest installed in this process; pytest's own handlers back afterwards."""
    import signal

    from gspo_mcore.preemption import SIGNALS, StopRequest

    saved = {sig: signal.getsignal(sig) for sig in SIGNALS}
    abandoned = []
    try:
        yield StopRequest(on_abandon=lambda: abandoned.append(True)), abandoned
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_a_signal_stops_at_once_while_starting_and_after_the_step_once_training(stop_request):
    import os
    import signal

    from gspo_mcore.preemption import Preempted

    stop, abandoned = stop_request
    with pytest.raises(SystemExit) as exited:  # starting (servers, weights): unwind at once
        os.kill(os.getpid(), signal.SIGTERM)
    assert exited.value.code == 128 + signal.SIGTERM
    stop.phase = "step"  # an update in progress: noted, finished first
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop.signum == signal.SIGTERM and not abandoned
    os.kill(os.getpid(), signal.SIGTERM)  # the same again at once (slurmstepd's, then torchrun's): one
    with pytest.raises(SystemExit):  # a second signal: at once
        os.kill(os.getpid(), signal.SIGINT)
    stop.signum, stop.phase = None, "rollout"  # rank 0 generating: the requests aborted, the rollout abandoned
    with pytest.raises(Preempted):
        os.kill(os.getpid(), signal.SIGUSR1)
    assert abandoned == [True] and stop.signum == signal.SIGUSR1


def test_a_run_starts_without_megatrons_apex_and_te_warnings():
    """Importing the trainer printed a dozen 'Apex / Transformer Engine not installed' lines."""
    import subprocess
    import sys

    from conftest import REPO

    proc = subprocess.run([sys.executable, "-c", "import gspo_mcore.train"], capture_output=True, text=True, cwd=REPO,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, timeout=300)
    assert proc.returncode == 0 and "not installed" not in proc.stderr, proc.stderr[-2000:]


def test_a_run_saved_with_loss_level_resumes_with_the_loss_function_it_named(tmp_path):
    """config.yaml of a run from before loss.function: its loss.level reads as the function."""
    config = load_config("configs/tiny_cpu_grpo.yaml")
    text = save(config, tmp_path).read_text()
    assert "  function: grpo\n" in text
    (tmp_path / "config.yaml").write_text(text.replace("  function: grpo\n", "  level: token\n"))
    assert check_resume(config, tmp_path) is None
    with pytest.raises(ConfigError, match=r"^--resume: loss.function \('grpo' -> 'gspo'\) differ"):
        check_resume(load_config("configs/tiny_cpu_grpo.yaml", ["loss.function=gspo"]), tmp_path)
