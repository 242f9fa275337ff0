"""`make demo`: the embedded CPU default, a real GSPO run on a laptop-sized problem.

It writes the toy task (a random tiny Qwen3-MoE, its word-level tokenizer and the prompts;
see gspo_mcore/toy_task.py) to outputs/demo/toy, trains it with configs/tiny_cpu.yaml (the
real Megatron-Core model, a real SGLang server on CPU that the run starts and stops, the
weights pushed to it after every step), prints the progress, writes the plots, and says
whether the model learned (mean reward of the last 10 steps vs the first 10).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from gspo_mcore.config import load_config
from gspo_mcore.plot import plot_runs
from gspo_mcore.toy_task import make_toy_task

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "tiny_cpu.yaml"
OUTPUT = REPO / "outputs" / "demo" / "tiny_cpu"


def main() -> int:
    os.chdir(REPO)  # the config's paths are relative to the repository
    config = load_config(CONFIG)
    make_toy_task(Path(config.model.hf_dir).parent, seed=0)
    if OUTPUT.exists():

        shutil.rmtree(OUTPUT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    print(f"GSPO on the toy task: {config.train.steps} steps, {config.train.rollout_batch_size} prompts x "
          f"{config.train.group_size} responses per step; a real SGLang server starts first (~30 s)", flush=True)
    proc = subprocess.run([sys.executable, "-m", "gspo_mcore.train", "--config", str(CONFIG),
                           "--output-dir", str(OUTPUT)], env=env)
    if proc.returncode != 0:
        print(f"demo: the training run failed (exit {proc.returncode}); logs in {OUTPUT / 'logs'}", file=sys.stderr)
        return 1
    rows = [json.loads(line) for line in (OUTPUT / "metrics.jsonl").read_text().splitlines()]
    first = sum(r["reward_mean"] for r in rows[:10]) / len(rows[:10])
    last = sum(r["reward_mean"] for r in rows[-10:]) / len(rows[-10:])
    plots = plot_runs([OUTPUT], OUTPUT / "plots", ["GSPO"])
    print(f"mean reward: first 10 steps {first:.3f} -> last 10 steps {last:.3f} ({last - first:+.3f})")
    print(f"metrics: {OUTPUT / 'metrics.jsonl'}; TensorBoard: {OUTPUT / 'tensorboard'}; plots: {plots[0].parent}")
    print("GSPO vs GRPO on the same task: .venv/bin/gspo-train --config configs/tiny_cpu_grpo.yaml "
          "--output-dir outputs/demo/tiny_cpu_grpo && .venv/bin/python -m gspo_mcore.plot outputs/demo/tiny_cpu "
          "outputs/demo/tiny_cpu_grpo --labels GSPO,GRPO")
    return 0 if last - first >= 0.3 else 1


if __name__ == "__main__":
    sys.exit(main())
