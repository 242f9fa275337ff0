"""`make demo`: the embedded CPU default, a real GSPO run on a laptop-sized problem.

    python -m gspo_mcore.run.demo [--output-dir DIR] [--overwrite | --resume]      (make demo DEMO_ARGS="...")

It writes the toy task (a random tiny Qwen3-MoE, its word-level tokenizer and the prompts;
see gspo_mcore/tasks/toy.py) to DIR/toy, trains it with configs/tiny_cpu.yaml into DIR/tiny_cpu
(the real Megatron-Core model, a real SGLang server on CPU that the run starts and stops, the
weights pushed to it after every step), prints the progress, writes the plots, and says
whether the model learned (mean reward of the last 10 steps vs the first 10). DIR defaults to
the checkout's outputs/demo. Nothing is deleted unless asked: a complete DIR/toy is reused (the
same seed writes the same files), and a DIR/tiny_cpu that holds a run is refused unless
--overwrite, which the trainer's --overwrite carries out (it removes only what a run writes), or
--resume, which continues it from its last checkpoint (a demo stopped by Ctrl-C).

Ctrl-C reaches the trainer too (the terminal signals the whole process group): the trainer
saves its last completed step and stops (a second Ctrl-C: at once), and the demo waits for it
and ends as the trainer did, by SIGINT (exit 130), adding nothing to the trainer's one line.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from gspo_mcore.run.cli import STOPPED
from gspo_mcore.config import load_config
from gspo_mcore.common.errors import InputError, run_cli
from gspo_mcore.run.plot import plot_runs
from gspo_mcore.run.directory import holds_run, resumable
from gspo_mcore.tasks.toy import make_toy_task

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "tiny_cpu.yaml"
DEFAULT_OUTPUT = REPO / "outputs" / "demo"


def train_command(output_dir: Path, overwrite: bool, resume: bool = False) -> list[str]:
    """The trainer on the CPU default, with the toy task in OUTPUT_DIR/toy, into OUTPUT_DIR/tiny_cpu."""
    toy = output_dir / "toy"
    return [sys.executable, "-m", "gspo_mcore.train", "--config", str(CONFIG), "--output-dir",
            str(output_dir / "tiny_cpu"), *(["--overwrite"] if overwrite else []), *(["--resume"] if resume else []),
            f"model.hf_dir={toy / 'model'}", f"data.path={toy / 'prompts.jsonl'}",
            f"eval.datasets=[{{name: toy, path: {toy / 'eval.jsonl'}, samples: 4, max_new_tokens: 3}}]"]


def check_run_dir(run: Path, overwrite: bool, resume: bool = False) -> None:
    """Refused before anything starts, with the demo's own options (the trainer's would name gspo-train's)."""
    if resume and not resumable(run):
        raise InputError(f"{run}: no checkpoint to resume (make demo without --resume starts a run)")
    if overwrite or resume or not holds_run(run):
        return
    again = ", make demo DEMO_ARGS=--resume continues it" if resumable(run) else ""
    raise InputError(f"{run}: holds a demo run already: make demo DEMO_ARGS=--overwrite replaces it{again}, "
                     f"make demo DEMO_ARGS=\"--output-dir DIR\" writes elsewhere")


def run_trainer(cmd: list[str], env: dict) -> int:
    """The trainer's exit code. A Ctrl-C at the terminal reaches the trainer as well (one process
    group), which decides what it means: the demo ignores it and waits (subprocess.run would kill
    the trainer 0.25 s into its save). A SIGTERM sent to the demo alone is passed on."""
    proc = subprocess.Popen(cmd, env=env)
    previous = {signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN),
                signal.SIGTERM: signal.signal(signal.SIGTERM, lambda signum, _: proc.send_signal(signum))}
    try:
        return proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m gspo_mcore.run.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT,
                        help="where the toy task (toy/) and the run (tiny_cpu/) go; default: outputs/demo")
    stop = parser.add_mutually_exclusive_group()
    stop.add_argument("--overwrite", action="store_true", help="replace the run OUTPUT_DIR/tiny_cpu holds")
    stop.add_argument("--resume", action="store_true", help="continue it from its last checkpoint")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    output_dir = args.output_dir.resolve()
    run = output_dir / "tiny_cpu"
    check_run_dir(run, args.overwrite, args.resume)
    config = load_config(CONFIG)
    make_toy_task(output_dir / "toy", seed=0)  # written whole or not at all (gspo_mcore.common.files)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    print(f"GSPO on the toy task: {config.train.steps} steps, {config.train.rollout_batch_size} prompts x "
          f"{config.train.group_size} responses per step; a real SGLang server starts first", flush=True)
    code = run_trainer(train_command(output_dir, args.overwrite, args.resume), env)
    if code == 2 or code in STOPPED:  # the trainer said why in one line: bad input, or stopped by a signal
        return code
    if code != 0:
        print(f"demo: the training run failed (exit {code}); logs in {run / 'logs'}", file=sys.stderr)
        return 1
    summary = json.loads((run / "summary.json").read_text())  # the run printed its lines (gspo_mcore.run.summary)
    plots = plot_runs([run], run / "plots", ["GSPO"])
    print(f"the exported model again: python -m gspo_mcore.evaluation.cli --config configs/tiny_cpu.yaml "
          f"--model {run}")
    print(f"metrics: {run / 'metrics.jsonl'}; TensorBoard: {run / 'tensorboard'}; plots: {plots[0].parent}")
    grpo, toy = output_dir / "tiny_cpu_grpo", output_dir / "toy"
    print(f"GSPO vs GRPO on the same task: .venv/bin/gspo-train --config configs/tiny_cpu_grpo.yaml --output-dir "
          f"{grpo} model.hf_dir={toy / 'model'} data.path={toy / 'prompts.jsonl'} && .venv/bin/python -m "
          f"gspo_mcore.run.plot {run} {grpo} --labels GSPO,GRPO")
    return 0 if summary.get("reward_gain", 0.0) >= 0.3 else 1


def demo_cli(argv=None) -> int:
    """`main` with Ctrl-C outside the training run (writing the task, the plots) as one line, exit 130."""
    try:
        return run_cli(lambda: main(argv))
    except KeyboardInterrupt:
        print("SIGINT: the demo stopped", file=sys.stderr, flush=True)
        return 128 + signal.SIGINT


def exit_as(code: int) -> None:
    """Exit with `code`; stopped by Ctrl-C, die of SIGINT, as a shell expects of a program Ctrl-C stopped
    (make then says "Interrupt", a shell loop around the demo stops too)."""
    if code == 128 + signal.SIGINT:
        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    sys.exit(code)


if __name__ == "__main__":
    exit_as(demo_cli())
