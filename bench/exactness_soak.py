"""Soak (not a test): float32 runs under strict exactness, repeated until one slips or all stay clean.

Each run is the CPU default (configs/tiny_cpu.yaml, the toy task) with a user's two-turn rollout
function (`two_turns` below: the model answers, the user's question is spliced in as environment
tokens, the model answers again; 3-token turns), `train.strict_exactness=true` and the sync check
every step: `--sync-steps` synchronous steps, then `--async-steps` asynchronous ones
(rollout.mode async, max_staleness 1: pushes land between a trajectory's turns and mid-turn),
each on its own server the run starts. A run the strict check stops leaves
OUTPUT_DIR/logs/exactness_step_N.json; this script prints, per run, the largest strict figure of
any step and where the evidence is.

    python bench/exactness_soak.py --runs 4 [--sync-steps 50] [--async-steps 10] [--load 1] [--smoke]
    python bench/exactness_soak.py --runs 8 --shared-server --losses gspo,sapo,gmpo,cispo --async-steps 0

`--load N`: N busy loops beside the runs (the two cores shared, as in the suite). `--smoke`: one
run of 2 + 2 steps. The last line is JSON: runs, clean runs, the largest figure, the evidence files.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


async def two_turns(task, engine):
    """A user's two-turn rollout function (rollout.function=exactness_soak:two_turns)."""
    from gspo_mcore.batch.trajectory import Trajectory

    prompt = engine.chat_ids(task.messages)
    trajectory = Trajectory(prompt_ids=prompt)
    reply = await engine.generate(prompt, max_new_tokens=3)
    trajectory.add_model(reply)
    trajectory.add_environment(engine.environment_ids([task.messages[-1]], reply.response_ids))
    reply = await engine.generate(prompt + trajectory.token_ids, max_new_tokens=3)
    trajectory.add_model(reply)
    trajectory.text = engine.tokenizer.decode(reply.response_ids, skip_special_tokens=True)
    return trajectory


def _spin() -> None:
    while True:
        pass


@contextlib.contextmanager
def _server(task: Path, root: Path):
    """One float32 server of the toy model, as the suite's session server (tests/conftest.py)."""
    from gspo_mcore.engines.sglang.server import sglang_command
    from gspo_mcore.engines.sglang.sglang_cpu import server_env
    from gspo_mcore.common.netaddr import free_port
    from gspo_mcore.common.processes import ManagedServer

    port = free_port()
    cmd = sglang_command(str(task / "model"), port, dtype="float32", max_running_requests=128,
                         extra_args=("--disable-radix-cache",))
    with ManagedServer(cmd, f"http://127.0.0.1:{port}", root / "sglang.log", env=server_env()) as managed:
        yield managed.url


def run_once(task: Path, out: Path, mode: str, steps: int, seed: int, extra: list[str]) -> dict:
    """One run; its strict figures per step, and the run's exit and evidence."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "bench"), str(REPO)]), "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "gspo_mcore.train", "--config", "configs/tiny_cpu.yaml", "--output-dir", str(out),
           f"model.hf_dir={task / 'model'}", f"data.path={task / 'prompts.jsonl'}", "eval.datasets=[]",
           "train.strict_exactness=true", "weight_sync.check_every=1",
           f"rollout.mode={mode}", f"train.steps={steps}", f"train.seed={seed}", "train.save_every=0",
           "train.save_final=false", "train.export_hf=false", "train.log_samples_every=0", *extra]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] \
        if (out / "metrics.jsonl").is_file() else []
    figures = [r["exactness_abs_log_ratio_max"] for r in rows if r.get("exactness_abs_log_ratio_max") is not None]
    evidence = sorted(str(p) for p in (out / "logs").glob("exactness_*.json")) if (out / "logs").is_dir() else []
    routing = [r["routing_mismatch_fraction"] for r in rows if r.get("routing_mismatch_fraction") is not None]
    return {"mode": mode, "seed": seed, "returncode": proc.returncode, "steps": len(rows),
            "max": max(figures, default=None), "evidence": evidence,
            "routing_mismatch_max": max(routing, default=None),
            "error": proc.stderr.strip().splitlines()[-1] if proc.returncode else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--sync-steps", type=int, default=50)
    parser.add_argument("--async-steps", type=int, default=10)
    parser.add_argument("--load", type=int, default=0)
    parser.add_argument("--routing", action="store_true",
                        help="also ask for the engine's routed experts (routing_mismatch_fraction per run)")
    parser.add_argument("--shared-server", action="store_true",
                        help="every run against one float32 server started here (rollout.urls), as the test suite's "
                             "runs share theirs, instead of a server of each run's own")
    parser.add_argument("--function", default="exactness_soak:two_turns",
                        help="rollout.function (single_turn: the CPU default's own)")
    parser.add_argument("--losses", default="gspo", help="comma-separated loss.function per run, in turn")
    parser.add_argument("--out", default=None, help="keep the runs here (default: a temporary directory)")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.runs, args.sync_steps, args.async_steps = 1, 2, 2
    from gspo_mcore.tasks.toy import make_toy_task

    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.load)]
    for p in spinners:
        p.start()
    results, losses = [], args.losses.split(",")
    with tempfile.TemporaryDirectory() as scratch, contextlib.ExitStack() as stack:
        root = Path(args.out or scratch)
        task = make_toy_task(root / "task", seed=0)
        shared = [f"rollout.urls=[{stack.enter_context(_server(task, root))}]"] if args.shared_server else []
        for run in range(args.runs):
            for mode, steps in (("sync", args.sync_steps), ("async", args.async_steps)):
                if steps:
                    extra = ["rollout.return_routed_experts=true"] if args.routing else []
                    extra += [*shared, f"loss.function={losses[run % len(losses)]}", f"rollout.function={args.function}"]
                    result = run_once(task, root / f"run{run}_{mode}", mode, steps, 1234 + run, extra)
                    results.append(result)
                    print(json.dumps(result), flush=True)
    for p in spinners:
        p.terminate()
    figures = [r["max"] for r in results if r["max"] is not None]
    print(json.dumps({"runs": len(results), "clean": sum(r["returncode"] == 0 for r in results),
                      "largest": max(figures, default=None), "steps": sum(r["steps"] for r in results),
                      "evidence": [e for r in results for e in r["evidence"]]}))


if __name__ == "__main__":
    main()
