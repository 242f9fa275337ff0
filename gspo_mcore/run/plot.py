"""PNG curves of one or more runs from their metrics.jsonl.

    python -m gspo_mcore.run.plot OUTPUT_DIR [OTHER_OUTPUT_DIR ...] [--out DIR] [--labels a,b]

One figure per `figure` of gspo_mcore.metrics.schema (reward, clip fraction, response length,
train-inference mismatch beside the clip band, step-time breakdown), each run a line (e.g.
GSPO vs GRPO on the same task). Written to --out; by default one run's go to its
OUTPUT_DIR/plots, a comparison's to a new directory named for the runs
(plots-RUN1-vs-RUN2 beside the first run), leaving each run's own figures alone.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

from gspo_mcore.common.errors import InputError, run_cli
from gspo_mcore.common.files import atomic_output
from gspo_mcore.metrics.schema import FIGURES

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

STACKED = "step_time"  # drawn as a stack per run (its parts add up to the step)
LOG_SCALE = {"mismatch"}  # the mismatch (1e-7 in float32, 1e-3 in bf16) beside the band it must stay under
# The y axis of a figure whose lines are of different things (else: its first metric's label).
AXIS = {"idle": "idle share of the step"}


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise InputError(f"{path}: no metrics (is {run_dir} a run's output directory?)")
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                raise InputError(f"{path}:{number}: not valid JSON") from None
    if not rows:
        raise InputError(f"{path}: empty")
    return rows


def read_evaluations(run_dir: Path) -> list[dict]:
    """The run's evaluations (eval.jsonl: the one before training, step 0, included); [] without."""
    path = Path(run_dir) / "eval.jsonl"
    if not path.is_file():
        return []
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except json.JSONDecodeError:
        raise InputError(f"{path}: not valid JSON") from None


def plot_runs(run_dirs: list[Path], out_dir: Path, labels: list[str] | None = None) -> list[Path]:
    """One PNG per figure of the metric schema: its metrics, each run a line (the step time as a
    stack per run)."""
    runs = [read_metrics(d) for d in run_dirs]
    evaluations = [read_evaluations(d) for d in run_dirs]
    labels = labels or [Path(d).name for d in run_dirs]
    if len(labels) != len(runs):
        raise InputError(f"--labels: {len(labels)} labels for {len(runs)} runs")
    out_dir.mkdir(parents=True, exist_ok=True)
    return [_save(fig, out_dir / f"{name}.png") for name, fig in figures(runs, labels, evaluations).items()]


def figures(runs: list[list[dict]], labels: list[str], evaluations: list[list[dict]] | None = None) -> dict:
    """{name: matplotlib figure} of the runs' metrics rows; `evaluations`: each run's eval.jsonl rows
    (with the evaluation before training), else the evaluations its metrics rows carry."""
    # A figure of figures no run reported (staleness, idle time: asynchronous runs only) is not drawn.
    out = {name: _stacked(metrics, labels, runs) if name == STACKED
           else _lines(metrics, labels, runs, name in LOG_SCALE, AXIS.get(name))
           for name, metrics in FIGURES.items()
           if name == STACKED or any(r.get(m.name) is not None for rows in runs for r in rows for m in metrics)}
    out["reward_wallclock"] = _reward_over_time(labels, runs)
    evaluated = [found or rows for found, rows in zip(evaluations or [[]] * len(runs), runs)]
    if any(k.startswith("eval/") for rows in evaluated for r in rows for k in r):
        out["eval"] = _evaluation(labels, evaluated)
    return out


def _evaluation(labels: list[str], runs: list[list[dict]]):
    """Each evaluation dataset's mean@k and pass@k over the steps evaluated (gspo_mcore.evaluation.held_out)."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, rows in zip(labels, runs):
        keys = sorted({k for r in rows for k in r if k.startswith("eval/") and ("/mean@" in k or "/pass@" in k)})
        largest = {}  # per dataset, its pass@k of the largest k
        for k in (k for k in keys if "/pass@" in k):
            dataset = k.rsplit("/", 1)[0]
            largest[dataset] = max(largest.get(dataset, k), k, key=lambda key: int(key.rsplit("@", 1)[1]))
        for key in [k for k in keys if "/mean@" in k] + sorted(largest.values()):
            points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            ax.plot(*zip(*points), marker="o", label=f"{label}: {key.removeprefix('eval/')}")
    ax.set_xlabel("step")
    ax.set_ylabel("held-out score")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig


def _reward_over_time(labels: list[str], runs: list[list[dict]]):
    """Reward against the run's own step time (summed): asynchronous and synchronous runs compared
    per second, not per step."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, rows in zip(labels, runs):
        elapsed, points = 0.0, []
        for r in rows:
            elapsed += r.get("time_step_s") or 0.0
            if r.get("reward_mean") is not None:
                points.append((elapsed / 60, r["reward_mean"]))
        if points:
            ax.plot(*zip(*points), label=label)
    ax.set_xlabel("training time (min, summed step times)")
    ax.set_ylabel("mean reward")
    ax.legend()
    ax.grid(alpha=0.3)
    return fig


def _lines(metrics, labels: list[str], runs: list[list[dict]], log: bool = False, axis: str | None = None):
    fig, ax = plt.subplots(figsize=(7, 4))
    if log:
        ax.set_yscale("log")
    for metric in metrics:
        per_run = [[(r["step"], r[metric.name]) for r in rows if r.get(metric.name) is not None] for rows in runs]
        if metric is not metrics[0] and len(runs) > 1 and all(points == per_run[0] for points in per_run):
            if per_run[0]:  # the same line in every run (the configured clip band): drawn once
                ax.plot(*zip(*per_run[0]), label=metric.label, color="black", linestyle="--")
            continue
        for label, points in zip(labels, per_run):
            if points:
                ax.plot(*zip(*points), label=label if len(metrics) == 1 else f"{label}: {metric.label}")
    ax.set_xlabel("step")
    ax.set_ylabel(axis or metrics[0].label)
    ax.legend()
    ax.grid(alpha=0.3)
    return fig


def _stacked(metrics, labels: list[str], runs: list[list[dict]]):
    fig, axes = plt.subplots(1, len(runs), figsize=(7 * len(runs), 4), squeeze=False, sharey=True)  # one scale
    for ax, label, rows in zip(axes[0], labels, runs):
        steps = [r["step"] for r in rows]
        ax.stackplot(steps, *[[r.get(m.name) or 0.0 for r in rows] for m in metrics], labels=[m.label for m in metrics])
        ax.set_title(label)
        ax.set_xlabel("step")
        ax.set_ylabel("step time (s)")
        ax.legend(loc="upper left")
    return fig


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    with atomic_output(path) as tmp:
        fig.savefig(tmp, dpi=100, format="png")  # the temporary's name has no .png to go by
    plt.close(fig)
    return path


def default_out(runs: list[Path]) -> Path:
    if len(runs) == 1:
        return runs[0] / "plots"
    return runs[0].resolve().parent / ("plots-" + "-vs-".join(run.resolve().name for run in runs))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m gspo_mcore.run.plot", description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--labels", default=None, help="comma-separated, one per run")
    args = parser.parse_args(argv)
    out = args.out or default_out(args.runs)
    for path in plot_runs(args.runs, out, args.labels.split(",") if args.labels else None):
        print(path)


if __name__ == "__main__":
    sys.exit(run_cli(main))
