"""Asynchronous GSPO against synchronous, measured side by side: the same task, seed and steps in
rollout.mode sync, one_step_off and async, with the trainer and the SGLang server pinned to
separate cores (taskset) so that overlap is physically possible on a 2-core machine.

    python bench/async.py --out DIR [--steps 8] [--modes sync,async] [--seeds 1,2,3] [--url URL] [--smoke]
                          [key=value ...]

`--url`: a running server of the task's model instead of one the bench starts (then nothing is
pinned). `--smoke`: sync and async, 2 steps of a small batch, 1 held-out sample per prompt: the
suite's check that the bench runs (the JSON line has every key, null for the modes not run).

The task is configs/long_cpu.yaml's (a bf16 engine) with long-tailed response lengths (the tiny
model stops at random: 8 to rollout.max_new_tokens tokens). Each mode is one real run
(`python -m gspo_mcore.train` on core 0) against one server the bench starts (core 1); each run
pushes its own initial weights first. A fourth run, `async-restart`, is async with
rollout.partial false (a push aborts the requests in flight, which start over), for comparison; a
fifth, `async-first-minibatch`, is async with pi_prox from the first minibatch's forward
(loss.proximal first_minibatch) instead of a recompute.
Prints a table, then one JSON line last:
{"async_speedup": samples/s async / sync, "one_step_off_speedup": ..., "async_restart_speedup": ...,
"overlap_bound": from the sync run's own phases, (rollout + train + sync) / max(rollout, train + sync),
"max_staleness_seen": ..., "tokens_regenerated": async's (0: a push retracts requests, which keep
their tokens), "tokens_regenerated_restart": async-restart's, "reward_last_steps": per mode, the
mean reward of the last quarter of the steps (learning per step), "reward_in_time": per mode, the
mean reward of the steps that ended in the last quarter of a wall-clock budget every mode shares
(learning per second), "reward_held_out": per mode, the final weights' mean reward on the 64
held-out prompts, 4 samples each (gspo-eval after the run: learning per update, without the lag of
a stale batch's own reward)}; with --seeds, each figure is the mean over the seeds (one table row per
seed and mode). --modes runs a subset (sync always).
Throughput is over steps 2.. (step 1 includes start-up). DIR/plots holds the runs' figures side by
side (gspo_mcore.run.plot), reward against summed step time among them (`reward_wallclock.png`: learning
per second; run `--steps 28` for long_cpu's whole curve); with several seeds, DIR/over_seeds.png
overlays every mode's mean over them (reward per step, reward per second, clip fraction). Not a test: the machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gspo_mcore.config import load_config  # noqa: E402
from gspo_mcore.tasks.long import make_long_task  # noqa: E402
from gspo_mcore.common.netaddr import free_port  # noqa: E402
from gspo_mcore.run.plot import plot_runs  # noqa: E402
from gspo_mcore.common.processes import ManagedServer  # noqa: E402
from gspo_mcore.engines.sglang.server import server_for_config  # noqa: E402

CONFIG = REPO / "configs" / "long_cpu.yaml"
# run name -> its overrides
MODES = {"sync": ["rollout.mode=sync"], "one_step_off": ["rollout.mode=one_step_off"], "async": ["rollout.mode=async"],
         "async-restart": ["rollout.mode=async", "rollout.partial=false"],
         "async-first-minibatch": ["rollout.mode=async", "loss.proximal=first_minibatch"]}
# export_hf: the final weights, evaluated after the run (held_out) so that no evaluation runs
# inside a run (an asynchronous producer would generate during it: a head start the step times hide).
DEFAULTS = ["rollout.max_new_tokens=160", "reward.norm=group", "train.export_hf=true", "train.save_final=false",
            "eval.datasets=[]"]
# The 64 held-out prompts, 4 samples each, at the task's own length.
EVAL = ("eval.datasets=[{name: long, path: outputs/long_task/eval.jsonl, samples: 4, temperature: 1.0, "
        "max_new_tokens: 40}]")


# The runs and evaluations on core 0 when the bench's own server has core 1 (none with --url).
PIN = ["taskset", "-c", "0"]
# --smoke: a small batch of short responses.
SMOKE = ["train.rollout_batch_size=2", "train.group_size=4", "rollout.max_new_tokens=16"]


def start_pinned_server(config, out: Path, stack: ExitStack) -> str:
    """The bench's server on core 1 (the runs take core 0), stopped when `stack` closes."""
    port = free_port()
    cmd, env = server_for_config(config, port)
    url = f"http://127.0.0.1:{port}"
    stack.enter_context(ManagedServer(["taskset", "-c", "1", *cmd], url, out / "sglang.log", env=env))
    return url


def _env() -> dict:
    """A run's or an evaluation's environment: this checkout, one OpenMP thread on its core."""
    return {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}


def run_mode(out: Path, mode: str, url: str, overrides: list[str]) -> list[dict]:
    """One run named `mode` (a key of MODES) against the server at `url`: its metrics rows."""
    run_dir = out / mode
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [*PIN, sys.executable, "-m", "gspo_mcore.train", "--config", str(CONFIG), "--output-dir",
           str(run_dir), *overrides, *MODES[mode], f"rollout.urls=[{url}]"]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{mode}: the run failed:\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def held_out(run_dir: Path, url: str, samples: int = 4) -> float:
    """The run's final weights (its hf/) on the held-out prompts, through gspo-eval on the bench's
    server (its figures: RUN/held_out.json): learning per update, free of the lag a stale batch's own reward carries (its responses
    came from older weights)."""
    proc = subprocess.run([*PIN, sys.executable, "-m", "gspo_mcore.evaluation.cli", "--config", str(CONFIG),
                           "--model", str(run_dir), "--urls", url, EVAL.replace("samples: 4", f"samples: {samples}")],
                          cwd=REPO, env=_env(), capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{run_dir}: the evaluation failed:\n{proc.stderr[-3000:]}")
    figures = proc.stdout.strip().splitlines()[-1]
    (run_dir / "held_out.json").write_text(figures + "\n")
    return json.loads(figures)[f"eval/long/mean@{samples}"]


def summary(rows: list[dict]) -> dict:
    steady = rows[1:]
    seconds = sum(r["time_step_s"] for r in steady)
    phase = {k: sum(r[f"time_{k}_s"] for r in steady) / len(steady) for k in ("rollout", "train", "sync")}
    return {"samples_per_s": sum(r["samples"] for r in steady) / seconds,
            "tokens_per_s": sum(r["trained_tokens_per_s"] * r["time_step_s"] for r in steady) / seconds,
            "step_s": seconds / len(steady), **{f"{k}_s": v for k, v in phase.items()},
            "reward_last": rows[-1]["reward_mean"], "staleness_max": max((r["staleness_max"] or 0) for r in rows),
            "idle": sum(r["trainer_idle_fraction"] or 0 for r in steady) / len(steady),
            "engine_idle": sum(r["engine_idle_fraction"] for r in steady) / len(steady),
            "tokens_regenerated": sum(r["tokens_regenerated"] for r in rows)}


def plot_over_seeds(runs: dict[int | None, dict[str, list[dict]]], path: Path) -> None:
    """Every mode's mean over the seeds, overlaid: reward per step, reward against summed step
    time (each seed's curve sampled on a shared time grid, up to the shortest run), and the clip
    fraction per step; the shaded band is the seeds' range."""
    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(next(iter(runs.values())))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    every = [rows for by_mode in runs.values() for rows in by_mode.values()]
    budget = min(sum(r["time_step_s"] for r in rows) for rows in every)
    grid = np.linspace(max(rows[0]["time_step_s"] for rows in every), budget, 60)  # every run has a step
    for mode in modes:
        per_seed = [by_mode[mode] for by_mode in runs.values()]
        steps = np.array([r["step"] for r in per_seed[0]])
        for ax, key in ((axes[0], "reward_mean"), (axes[2], "clip_fraction")):
            values = np.array([[r[key] if r.get(key) is not None else np.nan for r in rows] for rows in per_seed])
            ax.plot(steps, np.nanmean(values, 0), label=mode)
            ax.fill_between(steps, np.nanmin(values, 0), np.nanmax(values, 0), alpha=0.15)
        # Reward against time: each step's reward at the time it ended, held until the next.
        in_time = []
        for rows in per_seed:
            ends = np.cumsum([r["time_step_s"] for r in rows])
            rewards = np.array([r["reward_mean"] for r in rows])
            index = np.searchsorted(ends, grid, side="right") - 1
            in_time.append(rewards[index])
        in_time = np.array(in_time)
        axes[1].plot(grid / 60, np.nanmean(in_time, 0), label=mode)
        axes[1].fill_between(grid / 60, np.nanmin(in_time, 0), np.nanmax(in_time, 0), alpha=0.15)
    seeds = len(runs)
    for ax, title, xlabel in ((axes[0], "reward per step", "step"),
                              (axes[1], "reward per second", "training time (min, summed step times)"),
                              (axes[2], "clipped share of response tokens", "step")):
        ax.set_title(f"{title}, mean of {seeds} seeds (band: range)", fontsize=10)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def learning_in_time(runs: dict[str, list[dict]]) -> dict[str, float]:
    """Per mode, the mean reward of the steps that ended in the last quarter of a wall-clock budget
    shared by every mode (the shortest run's summed step time): what each mode had learnt by then,
    per second rather than per step."""
    budget = min(sum(r["time_step_s"] for r in rows) for rows in runs.values())
    out = {}
    for mode, rows in runs.items():
        ends = [sum(r["time_step_s"] for r in rows[:i + 1]) for i in range(len(rows))]
        window = [r["reward_mean"] for r, end in zip(rows, ends) if 0.75 * budget < end <= budget]
        out[mode] = sum(window) / len(window) if window else float("nan")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, among {', '.join(MODES)}")
    parser.add_argument("--seeds", default="", help="train.seed values, comma-separated (default: the config's)")
    parser.add_argument("--url", default="", help="a running server of the task's model (default: start one)")
    parser.add_argument("--smoke", action="store_true", help="sync and async, 2 steps of a small batch")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.modes, args.overrides = 2, "sync,async", [*SMOKE, *args.overrides]
    modes = [m for m in args.modes.split(",") if m]
    if "sync" not in modes or any(m not in MODES for m in modes):
        raise SystemExit(f"--modes: sync and any of {', '.join(MODES)}")
    seeds = [int(x) for x in args.seeds.split(",") if x] or [None]
    overrides = [*DEFAULTS, f"train.steps={args.steps}", *args.overrides]
    config = load_config(CONFIG, overrides)
    make_long_task(Path(config.model.hf_dir).parent)
    runs: dict[int | None, dict[str, list[dict]]] = {}
    evals: dict[tuple[int | None, str], float] = {}
    samples = 1 if args.smoke else 4
    if args.url:
        PIN.clear()
    with ExitStack() as stack:
        url = args.url or start_pinned_server(config, args.out, stack)
        for seed in seeds:
            out = args.out if seed is None else args.out / f"seed-{seed}"
            extra = [] if seed is None else [f"train.seed={seed}"]
            runs[seed] = {}
            for mode in modes:
                runs[seed][mode] = run_mode(out, mode, url, [*overrides, *extra])
                evals[(seed, mode)] = held_out(out / mode, url, samples)
            plot_runs([out / mode for mode in modes], out / "plots")
    if len(runs) > 1:
        plot_over_seeds(runs, args.out / "over_seeds.png")
    print("| seed | mode | samples/s | step s | rollout s | train s | sync s | trainer idle | engine idle | staleness max "
          "| tokens regenerated | reward (last quarter of steps) | reward (last quarter of the time budget) "
          "| held-out reward after the last step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    results, quarter = {}, max(1, args.steps // 4)
    for seed, by_mode in runs.items():
        in_time = learning_in_time(by_mode)
        for mode, rows in by_mode.items():
            r = summary(rows)
            r["reward_last_steps"] = sum(x["reward_mean"] for x in rows[-quarter:]) / quarter
            r["reward_in_time"] = in_time[mode]
            r["reward_held_out"] = evals[(seed, mode)]
            results[(seed, mode)] = r
            print(f"| {seed if seed is not None else '-'} | {mode} | {r['samples_per_s']:.1f} | {r['step_s']:.2f} | "
                  f"{r['rollout_s']:.2f} | {r['train_s']:.2f} | {r['sync_s']:.2f} | {r['idle']:.2f} | "
                  f"{r['engine_idle']:.2f} | {r['staleness_max']} | {r['tokens_regenerated']} | "
                  f"{r['reward_last_steps']:.3f} | {r['reward_in_time']:.3f} | {r['reward_held_out']:.3f} |")

    def mean(mode: str, key: str) -> float:
        return sum(results[(seed, mode)][key] for seed in runs) / len(runs)

    bound = sum((results[(s, "sync")]["rollout_s"] + results[(s, "sync")]["train_s"] + results[(s, "sync")]["sync_s"])
                / max(results[(s, "sync")]["rollout_s"], results[(s, "sync")]["train_s"] + results[(s, "sync")]["sync_s"])
                for s in runs) / len(runs)
    # Every mode's key, null for a mode not run: the line's keys never depend on --modes.
    line = {f"{m.replace('-', '_')}_speedup": None if m not in modes else
            sum(results[(s, m)]["samples_per_s"] / results[(s, "sync")]["samples_per_s"] for s in runs) / len(runs)
            for m in MODES if m != "sync"}
    line.update({"overlap_bound": bound, "max_staleness_seen": max(r["staleness_max"] for r in results.values())})
    line["tokens_regenerated"] = mean("async", "tokens_regenerated") if "async" in modes else None
    line["tokens_regenerated_restart"] = mean("async-restart", "tokens_regenerated") if "async-restart" in modes else None
    line["reward_last_steps"] = {m: mean(m, "reward_last_steps") for m in modes}
    line["reward_in_time"] = {m: mean(m, "reward_in_time") for m in modes}
    line["reward_held_out"] = {m: mean(m, "reward_held_out") for m in modes}
    print(json.dumps(line))


if __name__ == "__main__":
    main()
