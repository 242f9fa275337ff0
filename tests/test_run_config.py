"""Operating a run, the pure parts: what a --resume may change (gspo_mcore.run.saved_config), the LR
schedule over training steps (gspo_mcore.megatron.optimizer.lr_scheduler), torchrun's signal defaults."""

import math
import signal

import pytest
import torch

from gspo_mcore.config import ConfigError, load_config
from gspo_mcore.run.saved_config import check_resume, save


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
    from gspo_mcore.megatron.optimizer import lr_scheduler

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
    from gspo_mcore.run.torchrun import with_signal_defaults

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

    from gspo_mcore.run.preemption import SIGNALS, StopRequest

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

    from gspo_mcore.run.preemption import Preempted, duplicate_window_s

    stop, abandoned = stop_request
    assert stop.duplicate_s == 0  # a process on its own: each signal counts
    stop.duplicate_s = duplicate_window_s({"TORCHELASTIC_RUN_ID": "1"})  # a rank under torchrun
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

    from helpers import REPO

    proc = subprocess.run([sys.executable, "-c", "import gspo_mcore.run.trainer"], capture_output=True, text=True, cwd=REPO,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, timeout=300)
    assert proc.returncode == 0 and "not installed" not in proc.stderr, proc.stderr[-2000:]


def test_a_resume_keeps_the_first_runs_overrides_and_applies_its_own(tmp_path):
    """A 12-step run with optimizer.lr=0.0005, resumed with train.steps=40: the run's lr stays
    (it was dropped back to the file's 0.001), the step count changes; --config is optional."""
    from gspo_mcore.run.saved_config import resume_config

    first = load_config("configs/tiny_cpu.yaml", ["optimizer.lr=0.0005", "train.steps=12"])
    save(first, tmp_path)
    config, said = resume_config(tmp_path, None, ["train.steps=40"])
    assert config.optimizer.lr == 0.0005 and config.train.steps == 40
    assert said == ["resume: applying train.steps 12 -> 40"]
    config, said = resume_config(tmp_path, "configs/tiny_cpu.yaml", ["train.steps=40"])
    assert config.optimizer.lr == 0.0005 and config.train.steps == 40
    assert said[1].startswith(f"resume: the run's {tmp_path / 'config.yaml'} is the config; kept over "
                              "configs/tiny_cpu.yaml: optimizer.lr 0.0005 (not 0.001)")


def test_a_resume_without_a_saved_config_needs_the_config_file(tmp_path):
    from gspo_mcore.run.saved_config import resume_config

    with pytest.raises(ConfigError, match=r"^--resume: .*config.yaml not found: give --config"):
        resume_config(tmp_path, None, [])
    config, said = resume_config(tmp_path, "configs/tiny_cpu.yaml", ["train.steps=3"])
    assert config.train.steps == 3 and said == []


def test_a_directory_without_a_checkpoint_is_not_a_run_to_resume(tmp_path):
    from gspo_mcore.common.errors import InputError
    from gspo_mcore.run.directory import check_output_dir

    (tmp_path / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(InputError, match="holds a run that saved no checkpoint .*--overwrite replaces it"):
        check_output_dir(tmp_path, resume=False, overwrite=False)
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step_000002")
    with pytest.raises(InputError, match="holds a run already: --resume continues it"):
        check_output_dir(tmp_path, resume=False, overwrite=False)


def test_resume_needs_no_config_file_on_the_command_line():
    from gspo_mcore.run.cli import parse_args

    args = parse_args(["--resume", "--output-dir", "runs/x", "optimizer.lr=0.001"])
    assert args.config is None and args.overrides == ["optimizer.lr=0.001"]
    with pytest.raises(SystemExit):
        parse_args(["--output-dir", "runs/x"])  # a new run names its config
    with pytest.raises(SystemExit):
        parse_args(["--resume"])  # which run?


def test_a_run_saved_with_loss_level_resumes_with_the_loss_function_it_named(tmp_path):
    """config.yaml of a run from before loss.function: its loss.level reads as the function."""
    config = load_config("configs/tiny_cpu_grpo.yaml")
    text = save(config, tmp_path).read_text()
    assert "  function: grpo\n" in text
    (tmp_path / "config.yaml").write_text(text.replace("  function: grpo\n", "  level: token\n"))
    assert check_resume(config, tmp_path) is None
    with pytest.raises(ConfigError, match=r"^--resume: loss.function \('grpo' -> 'gspo'\) differ"):
        check_resume(load_config("configs/tiny_cpu_grpo.yaml", ["loss.function=gspo"]), tmp_path)
    from gspo_mcore.run.saved_config import resume_config

    resumed, _ = resume_config(tmp_path, None, [])
    assert resumed.loss.function == "grpo"  # resume_config reads an older saved config too


def test_help_and_usage_errors_answer_before_anything_heavy_is_imported():
    """`--help` or a usage error took ~10 s (torch, Megatron, transformers imported first)."""
    import subprocess
    import sys

    from helpers import REPO

    for args, code in ((["--help"], 0), (["--resume"], 2)):
        proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "gspo_mcore.train", *args], cwd=REPO,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == code and "gspo-train" in proc.stdout + proc.stderr
        imported = {line.split("|")[-1].strip().split(".")[0] for line in proc.stderr.splitlines() if "|" in line}
        assert not {"torch", "megatron", "transformers"} & imported, sorted(imported)


def test_what_a_resume_may_change_is_the_schemas_field_metadata():
    """The resume policy is `metadata=RESUME` beside each field (gspo_mcore.config.schema), not a
    list kept in step elsewhere: these are the fields it applied when it was a list."""
    import dataclasses

    from gspo_mcore.config import Config, resume_fields
    from gspo_mcore.config.reference import keys
    from gspo_mcore.run.saved_config import APPLIED_ON_RESUME, flat

    assert APPLIED_ON_RESUME == resume_fields() == {
        "optimizer.lr", "optimizer.lr_warmup_steps", "optimizer.lr_decay", "optimizer.min_lr",
        "train.steps", "train.save_every", "train.keep_checkpoints", "train.save_final", "train.export_hf",
        "train.wandb_project", "rollout.urls", "rollout.num_servers", "rollout.request_timeout_s",
        "rollout.max_attempts", "rollout.max_running_requests", "weight_sync.check_every",
        "weight_sync.master_address", "weight_sync.disk_dir", "weight_sync.bucket_mb",
        "distributed.timeout_minutes", "distributed.rollout_timeout_minutes", "reward.workers", "reward.timeout_s",
        "reward.url", "train.strict_exactness", "train.strict_exactness_tolerance", "model.fused_logprobs"}
    assert APPLIED_ON_RESUME <= set(flat(Config()))
    assert {key.name for key in keys() if key.resume} == APPLIED_ON_RESUME  # what --help-config and the page say

    @dataclasses.dataclass
    class Inner:
        n: int = dataclasses.field(default=1, metadata={"resume": True})

    @dataclasses.dataclass
    class Outer:
        inner: Inner = dataclasses.field(default_factory=Inner)
        m: int = 2

    assert resume_fields(Outer) == {"inner.n"}  # a section within a section is read too


@pytest.mark.parametrize("inside", ["weakref callback", "__del__"])
def test_a_second_signal_inside_a_finalizer_still_stops_at_once(inside):
    """A second Ctrl-C that arrives while the garbage collector runs a weakref callback (CI: in
    WeakSet's `_remove`, during a save) or a `__del__`: what the handler raises there Python prints
    as "Exception ignored" and drops, and the save went on. It stops the run at once all the same."""
    import subprocess
    import sys

    from helpers import REPO, environment

    body = "    pass\n" if inside == "weakref callback" else "    def __del__(self):\n        os.kill(os.getpid(), 2)\n"
    trigger = ("import weakref\nkept = [weakref.ref(Thing(), lambda _: os.kill(os.getpid(), signal.SIGINT))]\n"
               if inside == "weakref callback" else "Thing()\n")
    script = ("import os, signal, sys, time\n"
              "from gspo_mcore.run.preemption import StopRequest\n"
              "stop = StopRequest()\nstop.phase = 'step'\n"
              "os.kill(os.getpid(), signal.SIGINT)\n"  # the first: the step finishes, then the save
              f"class Thing:\n{body}"
              f"{trigger}"
              "for _ in range(300):\n    time.sleep(0.01)\n"
              "print('went on')\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=environment(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 130 and "went on" not in done.stdout, (done.stdout, done.stderr[-2000:])
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


def test_a_process_forked_from_the_trainer_dies_of_the_signal_silently():
    """Megatron's checkpoint writers are forked from the trainer during the save and share its
    process group: a second Ctrl-C reached them too, and each said "stopping now" with the trainer's
    handler (CI: three such lines). They die of the signal as without the handler, saying nothing."""
    import subprocess
    import sys

    from helpers import REPO, environment

    script = ("import os, signal, time\n"
              "from gspo_mcore.run.preemption import StopRequest\n"
              "stop = StopRequest()\nstop.phase = 'step'\n"
              "os.kill(os.getpid(), signal.SIGINT)\n"  # the first: the step finishes, then the save forks writers
              "child = os.fork()\n"
              "if child == 0:\n    time.sleep(30)\n    os._exit(0)\n"
              "time.sleep(0.5)\nos.kill(child, signal.SIGINT)\n"
              "_, status = os.waitpid(child, 0)\n"
              "print('child', os.WIFSIGNALED(status) and os.WTERMSIG(status))\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=environment(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["child", str(int(signal.SIGINT))], (done.stdout,
                                                                                                  done.stderr[-2000:])
    said = [line for line in done.stderr.splitlines() if line.startswith("SIGINT")]
    assert said == ["SIGINT: saving the last completed step, then stopping (SIGINT again: stop at once)"], said


def test_resuming_a_finished_run_is_one_line_before_anything_starts(tmp_path):
    """A run whose latest checkpoint is at train.steps: `--resume` started SGLang, pushed weights,
    trained nothing and reported 0.0 GiB after 32 s; now one line naming the step and the way on.
    A run short of its steps resumes."""
    import json

    from gspo_mcore.common.errors import InputError
    from gspo_mcore.megatron.checkpointing import latest_checkpoint
    from gspo_mcore.run.start import check_not_finished

    step = tmp_path / "run" / "checkpoints" / "step_000040"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text(json.dumps({"step": 40}))
    (tmp_path / "run" / "checkpoints" / "latest").write_text("step_000040")
    checkpoint = latest_checkpoint(tmp_path / "run")
    with pytest.raises(InputError) as finished:
        check_not_finished(checkpoint, 40)
    assert str(finished.value) == (f"{tmp_path / 'run'}: finished at step 40 of train.steps 40; raise train.steps "
                                   "(e.g. --resume train.steps=80) to continue")
    check_not_finished(checkpoint, 41)
