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
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

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
    from gspo_mcore.tasks.agent import make_agent_task

    runs = [(writer, DEMO_SEED) for writer in AGENT_WRITERS] + [(AGENT_WRITERS[0], seed) for seed in AGENT_SEEDS]
    found = []
    for writer, seed in runs:
        task = make_agent_task(out / f"task-{writer}", seed=writer)
        run = train(out / f"writer-{writer}" / f"seed-{seed}", "configs/agent_cpu.yaml",
                    [f"model.hf_dir={task / 'model'}", f"data.path={task / 'prompts.jsonl'}", f"train.seed={seed}",
                     "eval.datasets=[]", "train.export_hf=false", "train.save_every=0", "train.log_samples_every=0"],
                    30)
        summary = json.loads((run / "summary.json").read_text())
        found.append({"writer": writer, "seed": seed, "first": summary["reward_first"], "last": summary["reward_last"],
                      "gain": summary["reward_gain"]})
    return {"runs": found}


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
            rows = (out / "runs" / arm / f"seed-{seed}" / "metrics.jsonl").read_text().splitlines()
            rows = [json.loads(row) for row in rows]
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
    fmt = (lambda v, spec: "-" if v is None else format(v, spec))
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


BLOCKS = {
    "lineage_gains": Block("docs/07-loss.md", "the GSPO lineage's gains on the CPU default, 5 losses x 2 seeds",
                           lineage_gains, render_lineage),
    "demo": Block("README.md", "`make demo`'s first and last step and its summary", demo, render_demo),
    "losses_grid": Block("docs/07-loss.md", "every built-in loss on the long task, 7 losses x 3 seeds x 28 steps",
                         losses_grid, render_losses_grid,
                         (("losses.md", "docs/losses_grid.md"), ("reward.png", "docs/losses_reward.png"))),
    "agent": Block("docs/03-multi-turn.md", "the agent task's rise, 4 writer seeds and 2 more training seeds",
                   agent, render_agent),
    "engines": Block("docs/12-engines.md", "the CPU default on SGLang and on vLLM, side by side", engines,
                     render_engines),
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
        out = args.out / name
        out.mkdir(parents=True, exist_ok=True)
        # The revision and date the runs were made at, kept with them: a block rendered again from
        # runs made earlier says when those were made (a new DIR, or DIR/NAME removed, makes them anew).
        stamp = out / "made.json"
        if not stamp.is_file():
            stamp.write_text(json.dumps(dataclasses.asdict(made_now(name))) + "\n")
        made = Made(**json.loads(stamp.read_text()))
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
