"""The CPU default on each engine, side by side in one run: SGLang (configs/tiny_cpu.yaml) and
vLLM (configs/tiny_cpu_vllm.yaml), each its own toy task (the same prompts and seed; vLLM's model
has attention heads of 64, its CPU kernels' minimum).

    python bench/engines.py [--steps 40] [--out DIR] [--smoke]

Each engine trains the real trainer for `--steps` steps (its own server, started by the run),
one after the other on the same machine. Prints per engine the reward of the first and last 10
steps (or halves, under 20), the generated tokens per second over the steps, the mean step time,
the train-inference mismatch and the server's start time, then one JSON line:
`{"sglang": {...}, "vllm": {...}, "reward_gain_ratio": vllm / sglang, "tokens_per_s_ratio": ...}`.
`--smoke`: 2 steps each, no evaluation (the suite's check that the bench runs). Not a test: the
machine is noisy, so both run in one invocation.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
ENGINES = {"sglang": ("configs/tiny_cpu.yaml", None), "vllm": ("configs/tiny_cpu_vllm.yaml", 64)}


def run(engine: str, out: Path, steps: int, smoke: bool) -> dict:
    from gspo_mcore.tasks.toy import make_toy_task

    config, head_dim = ENGINES[engine]
    task = make_toy_task(out / f"{engine}_toy", seed=0, head_dim=head_dim)
    overrides = [f"model.hf_dir={task / 'model'}", f"data.path={task / 'prompts.jsonl'}", f"train.steps={steps}",
                 "train.save_every=0", "train.save_final=false", "train.export_hf=false",
                 "train.log_samples_every=0"]
    if smoke:
        overrides.append("eval.datasets=[]")
    else:
        overrides.append(f"eval.datasets=[{{name: toy, path: {task / 'eval.jsonl'}, samples: 4, max_new_tokens: 3}}]")
    began = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "gspo_mcore.train", "--config", config, "--output-dir",
                           str(out / engine), *overrides], cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{engine}: the run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    wall = time.monotonic() - began
    rows = [json.loads(line) for line in (out / engine / "metrics.jsonl").read_text().splitlines()]
    window = 10 if len(rows) >= 20 else max(1, len(rows) // 2)
    rewards = [r["reward_mean"] for r in rows]
    mismatch = [r["mismatch_abs_log_ratio_mean"] for r in rows if r["mismatch_abs_log_ratio_mean"] is not None]
    started = re.search(r"server\(s\) ready after (\d+) s", proc.stdout)
    return {"reward_first": sum(rewards[:window]) / window, "reward_last": sum(rewards[-window:]) / window,
            "reward_gain": (sum(rewards[-window:]) - sum(rewards[:window])) / window,
            "generated_tokens_per_s": sum(r["tokens_generated"] for r in rows) / sum(r["time_step_s"] for r in rows),
            "step_s": sum(r["time_step_s"] for r in rows) / len(rows),
            "mismatch_max": max(mismatch) if mismatch else None,
            "server_start_s": int(started.group(1)) if started else None, "run_s": wall, "steps": len(rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="training steps per engine")
    parser.add_argument("--out", help="where the runs go (default: a temporary directory)")
    parser.add_argument("--smoke", action="store_true", help="2 steps each, no evaluation")
    args = parser.parse_args()
    steps = 2 if args.smoke else args.steps
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        results = {engine: run(engine, out, steps, args.smoke) for engine in ENGINES}
    for engine, r in results.items():
        mismatch = "-" if r["mismatch_max"] is None else f"{r['mismatch_max']:.1e}"
        print(f"{engine:7s} reward {r['reward_first']:.3f} -> {r['reward_last']:.3f} (+{r['reward_gain']:.3f}) "
              f"| {r['generated_tokens_per_s']:.0f} generated tok/s | {r['step_s']:.2f} s/step | mismatch max "
              f"{mismatch} | server ready in {r['server_start_s']} s", flush=True)
    sglang, vllm = results["sglang"], results["vllm"]
    print(json.dumps({**results,
                      "reward_gain_ratio": vllm["reward_gain"] / sglang["reward_gain"] if sglang["reward_gain"] else None,
                      "tokens_per_s_ratio": vllm["generated_tokens_per_s"] / sglang["generated_tokens_per_s"],
                      "step_time_ratio": vllm["step_s"] / sglang["step_s"]}), flush=True)


if __name__ == "__main__":
    main()
