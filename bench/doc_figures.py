"""The figures the docs quote from runs, made again at this code by one command.

    python bench/doc_figures.py --list
    python bench/doc_figures.py NAME [NAME ...] [--out DIR]

Each figure sits in its doc between `<!-- figures: NAME -->` and `<!-- /figures: NAME -->`, and
its text names what made it: this command, the runs' config and seeds, the date and the git
revision. NAME runs what the block needs (under DIR/NAME, default outputs/doc_figures; a finished
run is not run again, so an interrupted one continues) and rewrites the block in place (the doc
written whole or not at all); the revision and date are those DIR/NAME's runs were started at, so
making a block again at new code takes a new DIR (or DIR/NAME removed). Not a test: a block's
figures move with the code, which is why the block says which code made them.
`tests/test_doc_figures.py` holds every marked block to an entry here and each entry's text to
naming its command and seeds.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import importlib.util
import math
import re
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import claim  # the claim grid's runner: its metrics reader and formatting, as bench/losses.py uses them

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "outputs" / "doc_figures"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO)}


@dataclass(frozen=True)
class Made:
    """Where a block's figures came from, said in the block."""
    command: str  # this script's, to make them again
    date: str
    revision: str


@dataclass(frozen=True)
class Block:
    doc: str  # relative to the repository
    what: str  # for --list
    make: Callable[[Path], dict]  # DIR -> the figures (runs what is not run yet)
    render: Callable[[dict, Made], str]  # the block's text
    files: tuple[tuple[str, str], ...] = ()  # (made under DIR, copied to this path of the repository)
    runs: str | None = None  # another block whose DIR (runs and stamp) this one renders from


# ---- the GSPO lineage on the CPU default (docs/07)

LINEAGE = ["gspo", "sapo", "cispo", "gmpo", "luspo"]
LINEAGE_SEEDS = [1234, 1235]
LINEAGE_STEPS = 30


def run(cmd: list[str], what: str, **options) -> subprocess.CompletedProcess:
    """`cmd` (said first) in the repository; its failure is one line naming `what`, with its stderr's end."""
    print(" ".join(cmd[1:]), flush=True)
    done = subprocess.run(cmd, cwd=REPO, env=ENV, text=True, stderr=subprocess.PIPE, **options)
    if done.returncode != 0:
        raise SystemExit(f"error: {what} failed:\n{done.stderr[-3000:]}")
    return done


def bench_line(path: Path, cmd: list[str]) -> dict:
    """A bench's last line (its JSON figures), kept in `path`: run only when not there yet."""
    if not path.is_file():
        path.write_text(run(cmd, cmd[1], stdout=subprocess.PIPE).stdout.strip().splitlines()[-1] + "\n")
    return json.loads(path.read_text())


def train(run_dir: Path, config: str, overrides: list[str], steps: int) -> Path:
    """One gspo-train run to its end into `run_dir` (kept when it finished: its summary.json and
    `steps` rows)."""
    rows = run_dir / "metrics.jsonl"
    if (run_dir / "summary.json").is_file() and rows.is_file() and len(rows.read_text().splitlines()) >= steps:
        return run_dir
    run([sys.executable, "-m", "gspo_mcore.train", "--config", config, "--output-dir", str(run_dir), "--overwrite",
         f"train.steps={steps}", *overrides], f"{run_dir}: the run", stdout=subprocess.DEVNULL)
    return run_dir


def lineage_gains(out: Path) -> dict:
    """Each loss at its defaults on configs/tiny_cpu.yaml: the mean reward's gain from its first 10
    to its last 10 steps (summary.json's), per seed."""
    from gspo_mcore.tasks.toy import make_toy_task

    toy = make_toy_task(out / "toy", seed=0)  # the demo's task, as `make demo` writes it
    task = [f"model.hf_dir={toy / 'model'}", f"data.path={toy / 'prompts.jsonl'}", "eval.datasets=[]",
            "train.export_hf=false", "train.save_every=0"]
    gains = {}
    for seed in LINEAGE_SEEDS:  # seed-major: an interrupted run has every loss at the same depth
        for loss in LINEAGE:
            run = train(out / loss / f"seed-{seed}", "configs/tiny_cpu.yaml",
                        [*task, f"loss.function={loss}", f"train.seed={seed}"], LINEAGE_STEPS)
            gains.setdefault(loss, []).append(json.loads((run / "summary.json").read_text())["reward_gain"])
    return {"gains": gains, "seeds": LINEAGE_SEEDS, "steps": LINEAGE_STEPS}


def render_lineage(figures: dict, made: Made) -> str:
    seeds = " and ".join(map(str, figures["seeds"]))
    each = ", ".join(f"{loss} {' / '.join(f'{g:+.2f}' for g in gains)}" for loss, gains in figures["gains"].items())
    return (f"Each trains the CPU default at its defaults (`configs/tiny_cpu.yaml`, {figures['steps']} steps, "
            f"`loss.function` set, seeds {seeds}; the mean reward's gain from the first 10 to the last 10 "
            f"steps, per seed): {each}. Made by `{made.command}` on {made.date} at {made.revision}; two seeds "
            "of a toy task rank nothing (the grid below has three on the long task).")


# ---- the demo's end (README)

DEMO_SEED = 1234  # configs/tiny_cpu.yaml's train.seed


def demo(out: Path) -> dict:
    """`make demo` into DIR: the lines the README quotes from what it printed."""
    log = out / "demo.log"
    if not (out / "tiny_cpu" / "summary.json").is_file():
        with open(log, "w") as printed:
            run([sys.executable, "-m", "gspo_mcore.run.demo", "--output-dir", str(out), "--overwrite"], "the demo",
                stdout=printed)
    lines = log.read_text().splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    tail = [line for line in lines if line.startswith(("mean reward:", "held-out ", "the exported model again:"))]
    return {"lines": [steps[0], "...", steps[-1], *tail], "seed": DEMO_SEED, "out": str(out)}


def render_demo(figures: dict, made: Made) -> str:
    text = "\n".join(figures["lines"]).replace(figures["out"], "outputs/demo")  # as `make demo` prints it
    return (f"```\n{text}\n```\n\n(Made by `{made.command}` on {made.date} at {made.revision}: `make demo`, "
            f"`train.seed` {figures['seed']}.)")


# ---- the agent task (docs/03)

AGENT_WRITERS = [0, 1, 2, 3]  # task writer seeds (0: the shipped task), each trained at train.seed 1234
AGENT_SEEDS = [1235, 1236]  # more training seeds, on writer seed 0


def agent(out: Path) -> dict:
    """configs/agent_cpu.yaml as shipped (30 steps), on each writer seed's task and on more training
    seeds of writer 0's: summary.json's first 10 -> last 10."""
    runs = [(writer, DEMO_SEED) for writer in AGENT_WRITERS] + [(AGENT_WRITERS[0], seed) for seed in AGENT_SEEDS]
    return {"runs": [agent_run(out, writer, seed) for writer, seed in runs]}


def agent_run(out: Path, writer: int, seed: int, key_hint: float | None = None, overrides=(), name: str = "") -> dict:
    """configs/agent_cpu.yaml (30 steps) on writer seed `writer`'s task (its warm start's prior
    `key_hint`, the writer's own by default) at train.seed `seed`, under DIR/[NAME/]writer-W/seed-S:
    summary.json's first 10 -> last 10, and the lowest step's reward and step."""
    from gspo_mcore.tasks.agent import make_agent_task

    hint = {} if key_hint is None else {"key_hint": key_hint}
    task = make_agent_task(out / (f"task-{writer}" + (f"-hint-{key_hint}" if hint else "")), seed=writer, **hint)
    run_dir = train(out / name / f"writer-{writer}" / f"seed-{seed}", "configs/agent_cpu.yaml",
                    [f"model.hf_dir={task / 'model'}", f"data.path={task / 'prompts.jsonl'}", f"train.seed={seed}",
                     "eval.datasets=[]", "train.export_hf=false", "train.save_every=0", "train.log_samples_every=0",
                     *overrides], 30)
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = claim.rows_of(run_dir)
    lowest = min(rows[1:], key=lambda r: r["reward_mean"])
    return {"writer": writer, "seed": seed, "first": summary["reward_first"], "last": summary["reward_last"],
            "gain": summary["reward_gain"], "lowest": lowest["reward_mean"], "lowest_step": lowest["step"]}


AGENT_WEAK_HINT = 0.1  # the shipped warm start's prior is gspo_mcore.tasks.agent.KEY_HINT (0.2)
AGENT_NO_WARMUP = ["optimizer.lr=1e-3", "optimizer.lr_warmup_steps=0"]


def agent_ablations(out: Path) -> dict:
    """What the agent task's settings are for, at train.seed 1234: a weaker prior (writer seeds 0
    and 1), none (writer seed 0), and no LR warmup at twice the LR (writer seeds 0-3)."""
    from gspo_mcore.tasks.agent import KEY_HINT

    return {"seed": DEMO_SEED, "key_hint": KEY_HINT, "weak_hint": AGENT_WEAK_HINT,
            "weak": [agent_run(out, w, DEMO_SEED, AGENT_WEAK_HINT, name="weak") for w in AGENT_WRITERS[:2]],
            "none": [agent_run(out, AGENT_WRITERS[0], DEMO_SEED, 0.0, name="none")],
            "no_warmup": [agent_run(out, w, DEMO_SEED, overrides=AGENT_NO_WARMUP, name="no-warmup")
                          for w in AGENT_WRITERS]}


def render_agent_ablations(figures: dict, made: Made) -> str:
    def runs(found: list[dict]) -> str:
        return ", ".join(f"writer seed {r['writer']} {r['first']:.2f} -> {r['last']:.2f} ({r['gain']:+.2f}; lowest "
                         f"step {r['lowest_step']} at {r['lowest']:.2f})" for r in found)

    return (f"Ablations (made by `{made.command}` on {made.date} at {made.revision}: `configs/agent_cpu.yaml`, 30 "
            f"steps at `train.seed` {figures['seed']}, first 10 steps -> last 10, and each run's lowest step after "
            f"the first): a prior of {figures['weak_hint']:.0%} instead of {figures['key_hint']:.0%} (the warm "
            f"start's share of calls that ask the prompt's key): {runs(figures['weak'])}; no prior: "
            f"{runs(figures['none'])}; no LR warmup at lr 1e-3 (`{' '.join(AGENT_NO_WARMUP)}`), the shipped prior: "
            f"{runs(figures['no_warmup'])}.")


def render_agent(figures: dict, made: Made) -> str:
    writers = [r for r in figures["runs"] if r["seed"] == DEMO_SEED]
    more = [r for r in figures["runs"] if r["seed"] != DEMO_SEED]
    gains = [r["gain"] for r in writers]
    return (f"Measured (made by `{made.command}` on {made.date} at {made.revision}: `configs/agent_cpu.yaml` as "
            f"shipped, 30 steps of 16 prompts x 8, lr 5e-4 after a 3-step warmup, on 2 cores), the mean reward of "
            f"the first 10 steps against the last 10, for writer seeds {', '.join(str(r['writer']) for r in writers)} "
            f"(each its own random model, warm start and prompts; 0 is the shipped task) at `train.seed` "
            f"{DEMO_SEED}: " + ", ".join(f"{r['first']:.2f} -> {r['last']:.2f}" for r in writers)
            + f" (rise {min(gains):+.2f} to {max(gains):+.2f}), and training seeds "
            + " and ".join(str(r["seed"]) for r in more) + " on the shipped task: "
            + ", ".join(f"{r['gain']:+.2f}" for r in more) + ".")


# ---- both engines side by side (docs/12)

ENGINE_STEPS = 40


def engines(out: Path) -> dict:
    """bench/engines.py's one JSON line (both engines in one invocation, SGLang first)."""
    line = bench_line(out / "engines.json", [sys.executable, "bench/engines.py", "--steps", str(ENGINE_STEPS),
                                             "--out", str(out / "runs")])
    return {**line, "seed": DEMO_SEED, "steps": ENGINE_STEPS}


def render_engines(figures: dict, made: Made) -> str:
    rows = []
    for engine, config in (("SGLang", "configs/tiny_cpu.yaml"), ("vLLM", "configs/tiny_cpu_vllm.yaml")):
        r = figures[engine.lower()]
        mismatch = "-" if r["mismatch_max"] is None else f"{r['mismatch_max']:.1e}"
        rows.append(f"| {engine} (`{config}`) | {r['reward_first']:.3f} -> {r['reward_last']:.3f} "
                    f"({r['reward_gain']:+.3f}) | {r['generated_tokens_per_s']:.0f} | {r['step_s']:.2f} | {mismatch} | "
                    f"{r['server_start_s']} s |")
    return (f"Made by `{made.command}` on {made.date} at {made.revision} (`python bench/engines.py --steps "
            f"{figures['steps']}`, `train.seed` {figures['seed']}; 2 cores, one run, SGLang first; each engine's "
            "model is the toy's with its own head size, 32 for SGLang, 64 for vLLM):\n\n"
            "| | reward, first 10 -> last 10 steps | generated tok/s | s / step | mismatch max (float32) | server ready |\n"
            "| --- | --- | --- | --- | --- | --- |\n" + "\n".join(rows))


# ---- every built-in loss on the long task (docs/07's grid)

GRID_SEEDS = [1234, 1235, 1236]  # bench/losses.py's three
GRID_FIRST = 7  # steps: the grid's start, as its reward is its last 7 of 28


def losses_grid(out: Path) -> dict:
    """bench/losses.py's grid (7 losses x 3 seeds x 28 steps on configs/long_cpu.yaml, its runs under
    DIR/runs), its JSON line, and each arm's first step and first 7 steps per seed."""
    arms = bench_line(out / "losses.json", [sys.executable, "bench/losses.py", "--out", str(out), "--seeds",
                                            str(len(GRID_SEEDS))])["arms"]
    starts = {}
    for arm in arms:
        for seed in GRID_SEEDS:
            rows = claim.rows_of(out / "runs" / arm / f"seed-{seed}")
            starts.setdefault(arm, []).append({"first_step": rows[0]["reward_mean"],
                                               "first_steps": sum(r["reward_mean"] for r in rows[:GRID_FIRST])
                                               / GRID_FIRST})
    return {"arms": arms, "starts": starts, "seeds": GRID_SEEDS}


def render_losses_grid(figures: dict, made: Made) -> str:
    arms, starts, seeds = figures["arms"], figures["starts"], figures["seeds"]
    first = ", ".join(f"{s['first_step']:.3f}" for s in starts["gspo"])
    opening = [s["first_steps"] for arm in arms for s in starts[arm]]
    head = (f"One grid on this 2-core CPU machine (`docs/losses_grid.md`, `docs/losses_reward.png`), made by "
            f"`{made.command}` on {made.date} at {made.revision} "
            f"(`python bench/losses.py --out DIR --seeds {len(seeds)}`, seeds {', '.join(map(str, seeds))}; each seed's "
            f"first step drew the same responses in every arm, reward {first}); reward is the mean of the last 7 "
            f"steps, mean +- sd over seeds (every arm's first {GRID_FIRST} steps: {min(opening):.2f}-"
            f"{max(opening):.2f}); clip is the share of response tokens the clip took; mismatch the mean |log s_i| "
            "of trainer vs engine at theta_old, and the share of sequences whose mismatch alone is outside the "
            "arm's band:")
    fmt = claim._fmt
    table = ["| loss | reward | clip | masked | mismatch / seq | out of band | response length | train s/step |",
             "|---|---|---|---|---|---|---|---|"]
    for arm, s in arms.items():
        masked = s.get("mismatch_truncated_fraction")
        masked = s.get("mismatch_masked_fraction") if masked is None else masked
        table.append(f"| {arm} | {s['final_reward_mean']:.3f} +- {s['final_reward_sd']:.3f} | "
                     f"{fmt(s['clip_fraction'], '.3f')} | {fmt(masked, '.1%')} | {fmt(s['mismatch_seq'], '.3g')} | "
                     f"{fmt(s['out_of_band'], '.0%')} | {fmt(s['response_length'], '.1f')} | "
                     f"{fmt(s['train_s_per_step'], '.2f')} |")
    base = arms["gspo"]["final_reward_per_seed"]
    per_seed = [f"| loss | {' | '.join(map(str, seeds))} | minus gspo, per seed |", "|---|" + "---|" * (len(seeds) + 1)]
    for arm, s in arms.items():
        values = s["final_reward_per_seed"]
        minus = "" if arm == "gspo" else ", ".join(f"{v - b:+.3f}" for v, b in zip(values, base))
        per_seed.append(f"| {arm} | {' | '.join(f'{v:.3f}' for v in values)} | {minus} |")
    return "\n".join([head, "", *table, "", f"Per seed ({', '.join(map(str, seeds))}), the same seed across a "
                      "column:", "", *per_seed])


# ---- the claim grid (docs/10; its mismatch paragraph, and its asynchronous arm in docs/02)

CLAIM_ARMS = ["gspo-engine", "gspo-recompute", "gspo-engine-paper", "gspo-recompute-paper", "grpo-engine",
              "grpo-recompute", "gspo-engine-replay", "gspo-engine-tokenmask", "gspo-engine-seqmask", "gspo-async"]
CLAIM_DECIDING = ["gspo-engine", "gspo-recompute", "gspo-engine-paper"]  # the question's three arms, on more seeds
CLAIM_SEEDS = [1234, 1235, 1236]  # bench/claim.py's first three
CLAIM_MORE_SEEDS = [1234, 1235, 1236, 1237, 1238, 1239]
CLAIM_THRESHOLD = 0.35  # bench/claim.py's --threshold default
PAPER_CLIP_HIGH = 4e-4
CLAIM_LABELS = {
    "gspo-engine": ("**GSPO, engine log-probs (default)**", "default"),
    "gspo-recompute": ("GSPO, recomputed, same band rule", "GSPO, recomputed, same band rule"),
    "gspo-engine-paper": ("GSPO, engine log-probs, paper band", "GSPO, engine log-probs, paper band"),
    "gspo-recompute-paper": ("GSPO, recomputed, paper band", "GSPO, recomputed, paper band"),
    "grpo-engine": ("GRPO, engine log-probs", "GRPO, engine log-probs"),
    "grpo-recompute": ("GRPO, recomputed", "GRPO, recomputed"),
    "gspo-engine-replay": ("GSPO, engine, routing replay (R3), paper band", "routing replay"),
    "gspo-engine-tokenmask": ("GSPO, engine, IcePop token mask [0.5, 2]", "token mask"),
    "gspo-engine-seqmask": ("GSPO, engine, DeepSeek-V3.2 sequence mask", "sequence mask"),
    "gspo-async": ("GSPO, asynchronous (max_staleness 1)", "asynchronous"),
}


def mean_of(rows: list[dict], key: str) -> float | None:
    return claim._mean([r.get(key) for r in rows])


def claim_grid_line(out: Path) -> dict:
    """bench/claim.py's grid (10 arms x 3 seeds x 28 steps on configs/long_cpu.yaml, under DIR/runs):
    its JSON line's arms, its claim.md and plots kept as claim3.md, reward3.png, clip_fraction3.png
    (a later call, claim_more's, rewrites them)."""
    grid = bench_line(out / "claim.json", [sys.executable, "bench/claim.py", "--out", str(out), "--seeds",
                                           str(len(CLAIM_SEEDS)), "--arms", ",".join(CLAIM_ARMS)])["arms"]
    if not (out / "claim6.json").is_file():
        for source in ("claim.md", "reward.png", "clip_fraction.png"):
            shutil.copyfile(out / source, out / source.replace(".", "3.", 1))
    return grid


def claim_grid(out: Path) -> dict:
    """The grid's arms, and from its runs each arm's first-step reward per seed, and the default's
    mismatch at step 1 and response length."""
    grid = claim_grid_line(out)
    runs = {arm: [claim.rows_of(out / "runs" / arm / f"seed-{seed}") for seed in CLAIM_SEEDS] for arm in CLAIM_ARMS}
    default = runs["gspo-engine"]
    return {"grid": grid, "seeds": CLAIM_SEEDS, "threshold": CLAIM_THRESHOLD,
            "first_rewards": {arm: [rows[0]["reward_mean"] for rows in by_seed] for arm, by_seed in runs.items()},
            "first_mismatch": [rows[0]["mismatch_abs_log_ratio_mean"] for rows in default],
            "response_length": statistics.mean(mean_of(rows, "response_length_mean") for rows in default)}


def claim_more(out: Path) -> dict:
    """The claim grid's three deciding arms on 6 seeds (the first three seeds' runs reused): its JSON line."""
    claim_grid_line(out)  # the grid first: its files are kept before this call rewrites them
    more = bench_line(out / "claim6.json", [sys.executable, "bench/claim.py", "--out", str(out), "--seeds",
                                            str(len(CLAIM_MORE_SEEDS)), "--arms", ",".join(CLAIM_DECIDING)])["arms"]
    return {"more": more, "more_seeds": CLAIM_MORE_SEEDS, "seeds": CLAIM_SEEDS}


def seeds_span(seeds: list[int]) -> str:
    return f"{seeds[0]}-{seeds[-1]}"


def claim_made(figures: dict, made: Made) -> str:
    return (f"made by `{made.command}` on {made.date} at {made.revision} (`python bench/claim.py --out DIR --seeds "
            f"{len(figures['seeds'])} --arms {','.join(figures['grid'])}`, seeds {seeds_span(figures['seeds'])})")


def reached(steps: list[int | None]) -> str:
    """Steps to the threshold per seed, '-' where a run never reached it."""
    return ", ".join("-" if v is None else str(v) for v in steps)


def paired(values: list[float], base: list[float]) -> tuple[float, float, list[float]]:
    """The mean of `values - base` seed by seed, its standard error, and the differences."""
    diffs = [v - b for v, b in zip(values, base)]
    return statistics.mean(diffs), statistics.stdev(diffs) / math.sqrt(len(diffs)), diffs


def render_claim_mismatch(figures: dict, made: Made) -> str:
    grid = figures["grid"]
    default, replay = grid["gspo-engine"], grid["gspo-engine-replay"]
    seq, tok, length = default["mismatch_seq"], default["mismatch_token"], figures["response_length"]
    first = statistics.mean(figures["first_mismatch"])
    routing = [s["routing_mismatch"] for arm, s in grid.items() if arm != "gspo-engine-replay"
               and s["routing_mismatch"] is not None]
    cut = 1 - replay["mismatch_seq"] / seq
    trend = "falling" if first > seq else "rising"
    return (f"**The mismatch.** On `configs/long_cpu.yaml` (the demo's tiny Qwen3-MoE, a bf16 SGLang engine, "
            f"~{length:.0f}-token responses whose reward counts every word), at theta = theta_old the trainer's and "
            f"the engine's per-token log-probs differ by a mean |d| of {tok:.4f}, and the length-normalised |log s_i| "
            f"of GSPO's sequence ratio is {seq:.4f} averaged over a run ({first:.4f} at the initial weights, {trend} "
            f"as the policy trains): {seq / PAPER_CLIP_HIGH:.0f}x the paper's upper clip of 4e-4, so "
            f"{default['out_of_band']:.0%} of sequences are outside the paper's band at theta_old. Where it comes "
            f"from, measured in the grid below ({claim_made(figures, made)}): {min(routing):.2%}-{max(routing):.2%} "
            "of (token, MoE layer) pairs route to a different top-k set in the engine than in the trainer (bf16 "
            f"rounding flips near-ties); replaying the engine's routing (`train.routing_replay`) cuts the "
            f"per-sequence mismatch from {seq:.4f} to {replay['mismatch_seq']:.4f} ({cut:.0%}) and the per-token one "
            f"from {tok:.4f} to {replay['mismatch_token']:.4f}. So the router is "
            f"{'most' if cut > 0.5 else 'part'} of it; the rest is bf16 arithmetic, zero-mean noise that length "
            f"normalisation shrinks as 1/sqrt(L) ({replay['mismatch_token']:.4f} / sqrt({length:.0f}) = "
            f"{replay['mismatch_token'] / math.sqrt(length):.4f}).")


def render_claim_grid(figures: dict, made: Made) -> str:
    grid, seeds, threshold = figures["grid"], figures["seeds"], figures["threshold"]
    per_seed = [{round(rewards[i], 6) for rewards in figures["first_rewards"].values()} for i in range(len(seeds))]
    if all(len(firsts) == 1 for firsts in per_seed):
        start = (f"each seed's first step draws the same responses in every arm (reward "
                 f"{', '.join(f'{min(firsts):.3f}' for firsts in per_seed)}), so arms part by what they train alone")
    else:
        start = "the arms' first steps drew rewards " + ", ".join(
            f"{min(firsts):.3f}-{max(firsts):.3f} on seed {seed}" for firsts, seed in zip(per_seed, seeds))
    head = (f"{len(grid) * len(seeds)} runs, {claim_made(figures, made)}; the full output is in "
            "[claim_grid.md](claim_grid.md); reward = mean of the last 7 of 28 steps, mean +- sd over "
            f"{len(seeds)} seeds; mismatch and out-of-band at theta_old; every request's sampling seeded "
            f"([Reproducible runs](09-reliability.md#reproducible-runs)): {start}. The runs one after another on "
            "2 cores, each arm's seed by seed (seed-major), so train s/step compares arms within the grid:")
    fmt = claim._fmt
    table = [f"| arm | reward | steps to {threshold} | \\|log s_i\\| | out of band | routing mismatch | clip fraction "
             "| train s/step |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for arm, s in grid.items():
        label = CLAIM_LABELS[arm][0]
        reward = f"{s['final_reward_mean']:.3f} +- {s['final_reward_sd']:.3f}"
        band = "-" if arm.startswith("grpo") else fmt(s["out_of_band"], ".0%")
        table.append(f"| {label} | {f'**{reward}**' if arm == 'gspo-engine' else reward} | "
                     f"{reached(s['steps_to_threshold'])} | "
                     f"{fmt(s['mismatch_seq'], '.4f')} | {band} | {fmt(s['routing_mismatch'], '.2%')} | "
                     f"{fmt(s['clip_fraction'], '.2f')} | {fmt(s['train_s_per_step'], '.2f')} |")
    base = grid["gspo-engine"]["final_reward_per_seed"]
    diffs = [f"| arm | {' | '.join(map(str, seeds))} | mean |", "| --- |" + " --- |" * (len(seeds) + 1)]
    for arm, s in grid.items():
        if arm != "gspo-engine":
            mean, _, d = paired(s["final_reward_per_seed"], base)
            diffs.append(f"| {CLAIM_LABELS[arm][1]} | {' | '.join(f'{x:+.3f}' for x in d)} | {mean:+.3f} |")
    return "\n".join([head, "", *table, "", "Each arm minus the default, per seed (the same seed draws the same "
                      "first responses in every arm):", "", *diffs, "",
                      f"![mean reward per step, each arm averaged over {len(seeds)} seeds](claim_reward.png)"])


def render_claim_more(figures: dict, made: Made) -> str:
    more, more_seeds, seeds = figures["more"], figures["more_seeds"], figures["seeds"]
    six = [f"| arm | reward, {len(more_seeds)} seeds | per seed | minus the default (SE) | train s/step |",
           "| --- | --- | --- | --- | --- |"]
    for arm, s in more.items():
        per_seed = ", ".join(f"{v:.3f}" for v in s["final_reward_per_seed"])
        minus = ""
        if arm != "gspo-engine":
            mean, se, d = paired(s["final_reward_per_seed"], more["gspo-engine"]["final_reward_per_seed"])
            side = (sum(x > 0 for x in d), "ahead") if mean > 0 else (sum(x < 0 for x in d), "behind")
            minus = f"{mean:+.3f} +- {se:.3f} ({side[0]} of {len(d)} {side[1]})"
        six.append(f"| {CLAIM_LABELS[arm][0].strip('*')} | {s['final_reward_mean']:.3f} +- {s['final_reward_sd']:.3f} "
                   f"| {per_seed} | {minus} | {s['train_s_per_step']:.2f} |")
    return (f"The question the grid is for, engine log-probs against recomputation under the same band rule, on "
            f"seeds {seeds_span(more_seeds)} for the three arms that decide it, made by `{made.command}` on "
            f"{made.date} at {made.revision} (`python bench/claim.py --out DIR --seeds {len(more_seeds)} --arms "
            f"{','.join(more)}` into the grid's DIR reuses its first {len(seeds)} seeds' runs):\n\n" + "\n".join(six))


def render_claim_async(figures: dict, made: Made) -> str:
    grid, seeds = figures["grid"], figures["seeds"]
    sync, stale = grid["gspo-engine"], grid["gspo-async"]
    rows = ["| arm | final reward | per seed | steps to 0.35 | clip fraction | band (later minibatches) |",
            "|---|---|---|---|---|---|"]
    for label, s in (("sync (default)", sync), ("async, max_staleness 1", stale)):
        rows.append(f"| {label} | {s['final_reward_mean']:.3f} +- {s['final_reward_sd']:.3f} | "
                    f"{', '.join(f'{v:.3f}' for v in s['final_reward_per_seed'])} | "
                    f"{reached(s['steps_to_threshold'])} | "
                    f"{s['clip_fraction']:.3f} | {s['clip_band_high']:.4f} |")
    mean, se, d = paired(stale["final_reward_per_seed"], sync["final_reward_per_seed"])
    return (f"**Learning (measured, seeded).** The claim grid's synchronous default and asynchronous arm "
            f"([Findings](10-findings.md)), {claim_made(figures, made)}: `configs/long_cpu.yaml`, 28 steps, final "
            f"reward over the last 7 steps, every request's sampling seeded, the runs one after another on 2 "
            "unpinned cores:\n\n" + "\n".join(rows) + f"\n\nAsync minus sync per seed: "
            f"{', '.join(f'{x:+.3f}' for x in d)} (mean {mean:+.3f} +- {se:.3f}; the synchronous seeds' own sd "
            f"{sync['final_reward_sd']:.3f}); routing mismatch {stale['routing_mismatch']:.2%} against "
            f"{sync['routing_mismatch']:.2%} of token-layer pairs.")


# ---- asynchronous against synchronous, pinned cores (docs/02)

ASYNC_SEEDS = [1, 2, 3, 4, 5, 6]
ASYNC_MODES = ["sync", "async", "async-first-minibatch"]  # pi_prox recomputed, and from the first minibatch
ASYNC_ARGS = ["--steps", "28", "--modes", ",".join(ASYNC_MODES), "--seeds", ",".join(map(str, ASYNC_SEEDS)),
              "rollout.max_new_tokens=40"]  # long_cpu's own length (the bench's default is 160)


def async_bench():
    """bench/async.py as a module (its name is a keyword): its per-run summary and learning_in_time."""
    spec = importlib.util.spec_from_file_location("async_bench", REPO / "bench" / "async.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def async_seeded(out: Path) -> dict:
    """bench/async.py's six seeds of sync against async, pi_prox recomputed and from the first
    minibatch (28 steps, pinned cores), and its JSON line; per seed and mode, from the runs under
    DIR/seed-S/MODE: samples/s, the reward per step (last 7), in time and held out, the clip
    fraction and the later minibatches' band."""
    line = bench_line(out / "async.json", [sys.executable, "bench/async.py", "--out", str(out), *ASYNC_ARGS])
    bench = async_bench()
    per_seed = []
    for seed in ASYNC_SEEDS:
        runs = {mode: claim.rows_of(out / f"seed-{seed}" / mode) for mode in ASYNC_MODES}
        in_time = bench.learning_in_time(runs)
        figures = {"seed": seed}
        for mode, rows in runs.items():
            held = json.loads((out / f"seed-{seed}" / mode / "held_out.json").read_text())["eval/long/mean@4"]
            figures[mode] = {"samples_per_s": bench.summary(rows)["samples_per_s"],
                             "per_step": sum(r["reward_mean"] for r in rows[-7:]) / 7, "in_time": in_time[mode],
                             "held_out": held, "clip_fraction": mean_of(rows, "clip_fraction"),
                             "band": mean_of(rows, "clip_band_high")}
        per_seed.append(figures)
    return {"line": line, "seeds": per_seed, "modes": ASYNC_MODES}


ASYNC_LABELS = {"sync": "sync", "async": "async", "async-first-minibatch": "first-minibatch"}


def render_async(figures: dict, made: Made) -> str:
    seeds, modes, line = figures["seeds"], figures["modes"], figures["line"]
    keys = ("per_step", "in_time", "held_out")
    label = {m: ASYNC_LABELS[m] for m in modes}
    header = [f"{label[m]} samples/s" for m in modes] + [f"{label[m]} {what}" for what in ("per step", "in time",
                                                                                           "held-out") for m in modes]
    table = ["| seed | " + " | ".join(header) + " |", "|---|" + "---|" * len(header)]
    for s in seeds:
        table.append(f"| {s['seed']} | " + " | ".join(f"{s[m]['samples_per_s']:.1f}" for m in modes) + " | "
                     + " | ".join(f"{s[m][k]:.3f}" for k in keys for m in modes) + " |")
    speedups = ["" if m == "sync" else f"{line[m.replace('-', '_') + '_speedup']:.2f}x" for m in modes]
    table.append("| mean +- sd | " + " | ".join(speedups) + " | " + " | ".join(
        f"{statistics.mean(s[m][k] for s in seeds):.3f} +- {statistics.stdev(s[m][k] for s in seeds):.3f}"
        for k in keys for m in modes) + " |")
    said = []
    for mode in modes[1:]:
        parts = []
        for k, what in zip(keys, ("per step", "per second (at the same wall-clock time)", "held out after 28 updates")):
            mean, se, d = paired([s[mode][k] for s in seeds], [s["sync"][k] for s in seeds])
            parts.append(f"{what} {mean:+.3f} +- {se:.3f} (ahead on {sum(x > 0 for x in d)} of {len(d)}; "
                         f"{', '.join(f'{x:+.3f}' for x in d)})")
        said.append(f"{label[mode].capitalize()} minus sync, paired by seed (mean +- standard error): " + "; ".join(parts))
    clip = ", ".join(f"{label[m]} {statistics.mean(s[m]['clip_fraction'] for s in seeds):.3f}" for m in modes)
    band = ", ".join(f"{statistics.mean(s[m]['band'] for s in seeds):.4f}" for m in modes)
    speeds = ", ".join(f"\"{m.replace('-', '_')}_speedup\": {line[m.replace('-', '_') + '_speedup']:.2f}"
                       for m in modes[1:])
    return (f"Made by `{made.command}` on {made.date} at {made.revision}: `python bench/async.py --out DIR "
            f"{' '.join(ASYNC_ARGS)}`, seeds {', '.join(str(s['seed']) for s in seeds)} (`train.seed`), the trainer "
            "pinned to core 0 and the server to core 1, nothing else running. \"Per step\" is the mean training "
            "reward over the last 7 steps, \"in time\" that of the steps that ended in the last quarter of a "
            "wall-clock budget the modes share, \"held-out\" the final weights on the 64 held-out prompts, 4 "
            "samples each:\n\n" + "\n".join(table) + "\n\n"
            f"`{{{speeds}, \"overlap_bound\": {line['overlap_bound']:.2f}, "
            f"\"max_staleness_seen\": {line['max_staleness_seen']}, \"tokens_regenerated\": "
            f"{line['tokens_regenerated']:.0f}}}`. " + ". ".join(said) + f". Clip fraction: {clip}, under a band "
            f"of {band}.")


# ---- the asynchronous modes' throughput, pinned cores (docs/02)

LONG_SEED = 1234  # configs/long_cpu.yaml's train.seed (the schema's default)
MODES_ARGS = ["--steps", "10"]  # every mode, responses up to the bench's 160 tokens
BALANCED_ARGS = ["--steps", "10", "--modes", "sync,one_step_off,async,async-first-minibatch", "train.ppo_epochs=4"]
MODE_COLUMNS = (("samples/s", "samples_per_s", ".1f"), ("step s", "step_s", ".2f"), ("rollout s", "rollout_s", ".2f"),
                ("train s", "train_s", ".2f"), ("sync s", "sync_s", ".2f"), ("trainer idle", "idle", ".2f"),
                ("engine idle", "engine_idle", ".2f"), ("staleness max", "staleness_max", "d"),
                ("tokens regenerated", "tokens_regenerated", "d"))


def async_modes_of(out: Path, args: list[str]) -> dict:
    """bench/async.py's one-seed run of `args` into DIR: its JSON line and each mode's summary
    (steps 2.., from DIR/MODE's metrics)."""
    line = bench_line(out / "async.json", [sys.executable, "bench/async.py", "--out", str(out), *args])
    modes = args[args.index("--modes") + 1].split(",") if "--modes" in args else list(async_bench().MODES)
    bench = async_bench()
    return {"line": line, "args": args, "seed": LONG_SEED,
            "modes": {mode: bench.summary(claim.rows_of(out / mode)) for mode in modes}}


def async_modes(out: Path) -> dict:
    return async_modes_of(out, MODES_ARGS)


def async_balanced(out: Path) -> dict:
    return async_modes_of(out, BALANCED_ARGS)


def render_modes(figures: dict, made: Made) -> str:
    modes, line = figures["modes"], figures["line"]
    steps = int(figures["args"][figures["args"].index("--steps") + 1])
    table = ["| mode | " + " | ".join(c[0] for c in MODE_COLUMNS) + " |", "|---|" + "---|" * len(MODE_COLUMNS)]
    for mode, r in modes.items():
        table.append(f"| {mode} | " + " | ".join(format(r[key], spec) for _, key, spec in MODE_COLUMNS) + " |")
    sync = modes["sync"]
    bound = line["overlap_bound"]
    said = [f"Generation is {sync['rollout_s'] / sync['step_s']:.0%} of a synchronous step, so overlap alone "
            f"could give at most {bound:.2f}x"]
    for mode in modes:
        if mode == "sync":
            continue
        speedup = line[f"{mode.replace('-', '_')}_speedup"]
        said.append(f"{mode} {speedup:.2f}x ({speedup / bound:.0%} of the bound; its train phase "
                    f"{modes[mode]['train_s'] / sync['train_s']:.2f}x sync's, the engine idle "
                    f"{modes[mode]['engine_idle']:.0%} of the time against {sync['engine_idle']:.0%})")
    return (f"Made by `{made.command}` on {made.date} at {made.revision}: `python bench/async.py --out DIR "
            f"{' '.join(figures['args'])}`, `train.seed` {figures['seed']} (configs/long_cpu.yaml's) in every mode, "
            f"{steps} steps (steps 2-{steps}: the first includes start-up), the trainer pinned to core 0 and the "
            "server to core 1, nothing else running:\n\n" + "\n".join(table) + "\n\n"
            + "; ".join(said) + f". Max staleness seen: {line['max_staleness_seen']}.")


# ---- where the mismatch comes from (docs/10)

MISMATCH_ROWS = (("float32 trainer (what training sees)", "bf16 engine vs fp32 trainer"),
                 ("trainer with bf16-rounded weights, float32 compute", "bf16 engine vs bf16 weights trainer"),
                 ("trainer in bf16 (weights and compute)", "bf16 engine vs bf16 trainer"),
                 ("its own prefill of the same tokens (decoding, batching)", "bf16 engine decode vs its prefill"),
                 ("(float32 engine vs float32 trainer)", "fp32 engine vs fp32 trainer"))


def small(x: float) -> str:
    """A mismatch: four decimals, or two significant digits below 1e-3 (a float32 engine's ~1e-7)."""
    return f"{x:.4f}" if x >= 1e-3 else f"{x:.1e}"


def mismatch_sources(out: Path) -> dict:
    """bench/mismatch_sources.py at its defaults (32 responses of configs/long_cpu.yaml at the
    initial weights, each request seeded from train.seed): its JSON line."""
    run([sys.executable, "-m", "gspo_mcore.tasks.long", "outputs/long_task"], "the long task", stdout=subprocess.DEVNULL)
    return {"line": bench_line(out / "mismatch_sources.json", [sys.executable, "bench/mismatch_sources.py"]),
            "seed": LONG_SEED}


def render_mismatch_sources(figures: dict, made: Made) -> str:
    line = figures["line"]
    table = ["| engine vs | \\|log s_i\\| | tokens \\|d\\| > 0.1 | routing flips (token, layer) vs float32 |",
             "| --- | --- | --- | --- |"]
    for label, key in MISMATCH_ROWS:
        r = line[key]
        flips = r.get("routing_flips_vs_fp32")
        flips = "-" if flips is None or key.endswith("fp32 trainer") else f"{flips:.1%}"  # vs itself: 0
        table.append(f"| {label} | {small(r['seq_mean_abs_log_ratio'])} | {r['token_share_abs_over_0.1']:.0%} | {flips} |")
    trainer, alone = line["bf16 engine vs fp32 trainer"], line["bf16 trainer vs fp32 trainer"]
    return (f"Made by `{made.command}` on {made.date} at {made.revision}: `python bench/mismatch_sources.py` (32 "
            f"responses of configs/long_cpu.yaml at the initial weights, every request's sampling seeded from "
            f"`train.seed` {figures['seed']}; per sequence mean |log s_i|, all at theta_old):\n\n" + "\n".join(table)
            + "\n\n"
            f"Against the float32 trainer: the per-token bias's t-statistic is {trainer['bias_t']:.1f}; zeroing the "
            f"tail (|d| > 0.1) leaves |log s_i| {small(trainer['seq_mean_abs_log_ratio_tail_zeroed'])}; subtracting "
            f"the first half's mean offset from the second half leaves "
            f"{trainer['seq_out_of_band_after_first_half_offset']:.0%} of those sequences out of the paper's band "
            f"({trainer['seq_out_of_band']:.0%} before); a band holding 90% of sequences is "
            f"{small(trainer['seq_band_for_90pct'])}. bf16 against float32 with no engine: the "
            f"{alone['tokens_flipped']:.0%} of tokens that any layer routes differently carry mean |d| "
            f"{alone['mean_abs_d_flipped_tokens']:.3f} against {alone['mean_abs_d_other_tokens']:.3f} for the rest.")


# ---- step time, the engine's log-probs against recomputation (docs/10)

STEP_ARGS = ["--steps", "8"]


def step_time(out: Path) -> dict:
    """bench/step.py --steps 8 on configs/long_cpu.yaml: its JSON line."""
    run([sys.executable, "-m", "gspo_mcore.tasks.long", "outputs/long_task"], "the long task", stdout=subprocess.DEVNULL)
    return {"line": bench_line(out / "step.json", [sys.executable, "bench/step.py", *STEP_ARGS]), "seed": LONG_SEED}


def render_step_time(figures: dict, made: Made) -> str:
    line = figures["line"]
    return (f"Made by `{made.command}` on {made.date} at {made.revision}: `python bench/step.py "
            f"{' '.join(STEP_ARGS)}` (configs/long_cpu.yaml, `train.seed` {figures['seed']}, both arms on the same "
            f"{line['steps']} batches after a warm-up step, nothing else running): {line['engine_step_s']:.2f} s a "
            f"step with the engine's log-probs against {line['recompute_step_s']:.2f} s recomputing "
            f"(`step_time_ratio` {line['step_time_ratio']:.2f}); the train phase {line['engine_train_s']:.2f} s "
            f"against {line['recompute_train_s']:.2f} s (`train_time_ratio` {line['train_time_ratio']:.2f}); "
            f"generation is {line['rollout_s'] / line['engine_step_s']:.0%} of the engine arm's step.")


BLOCKS = {
    "lineage_gains": Block("docs/07-loss.md", "the GSPO lineage's gains on the CPU default, 5 losses x 2 seeds",
                           lineage_gains, render_lineage),
    "demo": Block("README.md", "`make demo`'s first and last step and its summary", demo, render_demo),
    "losses_grid": Block("docs/07-loss.md", "every built-in loss on the long task, 7 losses x 3 seeds x 28 steps",
                         losses_grid, render_losses_grid,
                         (("losses.md", "docs/losses_grid.md"), ("reward.png", "docs/losses_reward.png"))),
    "agent": Block("docs/03-multi-turn.md", "the agent task's rise, 4 writer seeds and 2 more training seeds",
                   agent, render_agent),
    "agent_ablations": Block("docs/03-multi-turn.md", "the agent task with a weaker prior, none, and no LR warmup",
                             agent_ablations, render_agent_ablations),
    "engines": Block("docs/12-engines.md", "the CPU default on SGLang and on vLLM, side by side", engines,
                     render_engines),
    "claim_grid": Block("docs/10-findings.md", "the claim grid, 10 arms x 3 seeds x 28 steps, 3 of them on 6 seeds",
                        claim_grid, render_claim_grid,
                        (("claim3.md", "docs/claim_grid.md"), ("reward3.png", "docs/claim_reward.png"),
                         ("clip_fraction3.png", "docs/claim_clip_fraction.png"))),
    "claim_more": Block("docs/10-findings.md", "the claim grid's three deciding arms on 6 seeds", claim_more,
                        render_claim_more, runs="claim_grid"),
    "claim_mismatch": Block("docs/10-findings.md", "the train-inference mismatch the claim grid measured", claim_grid,
                            render_claim_mismatch, runs="claim_grid"),
    "claim_async": Block("docs/02-async.md", "the claim grid's synchronous and asynchronous arms", claim_grid,
                         render_claim_async, runs="claim_grid"),
    "async_seeded": Block("docs/02-async.md", "sync against async on pinned cores, 6 seeds x 28 steps", async_seeded,
                          render_async, (("over_seeds.png", "docs/async_over_seeds_seeded.png"),)),
    "async_modes": Block("docs/02-async.md", "every rollout mode's throughput on pinned cores, 10 steps", async_modes,
                         render_modes),
    "async_balanced": Block("docs/02-async.md", "the same with four passes over each batch (train.ppo_epochs=4)",
                            async_balanced, render_modes),
    "mismatch_sources": Block("docs/10-findings.md", "where the mismatch comes from, op by op (32 responses)",
                              mismatch_sources, render_mismatch_sources),
    "step_time": Block("docs/10-findings.md", "step time, the engine's log-probs against recomputation",
                       step_time, render_step_time),
}


# ---- the blocks in the docs

def marked(text: str) -> dict[str, str]:
    """NAME -> the text between its markers, for every marked block of a doc."""
    found = re.findall(r"<!-- figures: (\w+) -->\n(.*?)\n<!-- /figures: \1 -->", text, flags=re.S)
    return dict(found)


def replaced(text: str, name: str, block: str) -> str:
    """`text` with block `name`'s contents replaced (a one-line error if it has no such block)."""
    pattern = re.compile(rf"(<!-- figures: {name} -->\n).*?(\n<!-- /figures: {name} -->)", flags=re.S)
    if not pattern.search(text):
        raise SystemExit(f"error: no block '{name}' (<!-- figures: {name} --> ... <!-- /figures: {name} -->)")
    return pattern.sub(lambda m: m.group(1) + block + m.group(2), text, count=1)


def made_now(name: str) -> Made:
    revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True).stdout.strip() or "an unknown revision"
    return Made(f"python bench/doc_figures.py {name}", datetime.date.today().isoformat(), revision)


def write(doc: Path, content: str | bytes) -> None:
    """`doc` written whole or not at all."""
    tmp = doc.with_name(doc.name + ".tmp")
    tmp.write_bytes(content.encode() if isinstance(content, str) else content)
    tmp.replace(doc)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"blocks to make again, of {', '.join(BLOCKS)}")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the runs go (DIR/NAME)")
    parser.add_argument("--list", action="store_true", help="each block: its doc and what it holds")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in BLOCKS]
    if unknown:
        raise SystemExit(f"error: {unknown[0]!r} is not a block: one of {', '.join(BLOCKS)}")
    if args.list or not args.names:
        for name, block in BLOCKS.items():
            print(f"{name}: {block.doc}: {block.what}")
        return 0
    sys.path.insert(0, str(REPO))
    for name in args.names:
        block = BLOCKS[name]
        out = args.out / (block.runs or name)
        out.mkdir(parents=True, exist_ok=True)
        # The revision and date the runs were made at, kept with them: a block rendered again from
        # runs made earlier says when those were made (a new DIR, or DIR/NAME removed, makes them anew).
        stamp = out / "made.json"
        if not stamp.is_file():
            stamp.write_text(json.dumps(dataclasses.asdict(made_now(name))) + "\n")
        # Its command is this block's own (a block may render another's runs).
        made = dataclasses.replace(Made(**json.loads(stamp.read_text())), command=f"python bench/doc_figures.py {name}")
        figures = block.make(out)
        (out / "figures.json").write_text(json.dumps(figures, indent=1) + "\n")
        doc = REPO / block.doc
        write(doc, replaced(doc.read_text(), name, block.render(figures, made)))
        for source, kept in block.files:
            write(REPO / kept, (out / source).read_bytes())
        print(f"{name}: {block.doc} rewritten", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
