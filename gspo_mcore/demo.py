"""`make demo`: the embedded CPU default, a real GSPO run on a laptop-sized problem.

    python -m gspo_mcore.demo [--output-dir DIR] [--overwrite]      (make demo DEMO_ARGS="...")

It writes the toy task (a random tiny Qwen3-MoE, its word-level tokenizer and the prompts;
see gspo_mcore/toy_task.py) to DIR/toy, trains it with configs/tiny_cpu.yaml into DIR/tiny_cpu
(the real Megatron-Core model, a real SGLang server on CPU that the run starts and stops, the
weights pushed to it after every step), prints the progress, writes the plots, and says
whether the model learned (mean reward of the last 10 steps vs the first 10). DIR defaults to
the checkout's outputs/demo. Nothing is deleted unless asked: a complete DIR/toy is reused (the
same seed writes the same files), and a DIR/tiny_cpu that holds a run is refused unless
--overwrite, which the trainer's --overwrite carries out (it removes only what a run writes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from gspo_mcore.config import load_config
from gspo_mcore.errors import run_cli
from gspo_mcore.plot import plot_runs
from gspo_mcore.toy_task import make_toy_task

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "tiny_cpu.yaml"
DEFAULT_OUTPUT = REPO / "outputs" / "demo"


def train_command(output_dir: Path, overwrite: bool) -> list[str]:
    """The trainer on the CPU default, with the toy task in OUTPUT_DIR/toy, into OUTPUT_DIR/tiny_cpu."""
    toy = output_dir / "toy"
    return [sys.executable, "-m", "gspo_mcore.train", "--config", str(CONFIG), "--output-dir",
            str(output_dir / "tiny_cpu"), *(["--overwrite"] if overwrite else []),
            f"model.hf_dir={toy / 'model'}", f"data.path={toy / 'prompts.jsonl'}",
            f"eval.datasets=[{{name: toy, path: {toy / 'eval.jsonl'}, samples: 4, max_new_tokens: 3}}]"]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m gspo_mcore.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT,
                        help="where the toy task (toy/) and the run (tiny_cpu/) go; default: outputs/demo")
    parser.add_argument("--overwrite", action="store_true", help="replace the run OUTPUT_DIR/tiny_cpu holds")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    output_dir = args.output_dir.resolve()
    run = output_dir / "tiny_cpu"
    config = load_config(CONFIG)
    make_toy_task(output_dir / "toy", seed=0)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    print(f"GSPO on the toy task: {config.train.steps} steps, {config.train.rollout_batch_size} prompts x "
          f"{config.train.group_size} responses per step; a real SGLang server starts first (45-140 s on CPU)", flush=True)
    proc = subprocess.run(train_command(output_dir, args.overwrite), env=env)
    if proc.returncode == 2:  # the trainer named the input it refused (a run already there: --overwrite)
        return 2
    if proc.returncode != 0:
        print(f"demo: the training run failed (exit {proc.returncode}); logs in {run / 'logs'}", file=sys.stderr)
        return 1
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    first = sum(r["reward_mean"] for r in rows[:10]) / len(rows[:10])
    last = sum(r["reward_mean"] for r in rows[-10:]) / len(rows[-10:])
    plots = plot_runs([run], run / "plots", ["GSPO"])
    print(f"mean reward: first 10 steps {first:.3f} -> last 10 steps {last:.3f} ({last - first:+.3f})")
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    print(f"held-out accuracy (mean@4): before training {evals[0]['eval/toy/mean@4']:.3f} -> after "
          f"{evals[-1]['eval/toy/mean@4']:.3f} (python -m gspo_mcore.evaluate --config configs/tiny_cpu.yaml "
          f"--model {run / 'hf'} evaluates the exported model)")
    print(f"metrics: {run / 'metrics.jsonl'}; TensorBoard: {run / 'tensorboard'}; plots: {plots[0].parent}")
    grpo, toy = output_dir / "tiny_cpu_grpo", output_dir / "toy"
    print(f"GSPO vs GRPO on the same task: .venv/bin/gspo-train --config configs/tiny_cpu_grpo.yaml --output-dir "
          f"{grpo} model.hf_dir={toy / 'model'} data.path={toy / 'prompts.jsonl'} && .venv/bin/python -m "
          f"gspo_mcore.plot {run} {grpo} --labels GSPO,GRPO")
    return 0 if last - first >= 0.3 else 1


if __name__ == "__main__":
    sys.exit(run_cli(main))
