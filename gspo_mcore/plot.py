"""PNG curves of one or more runs from their metrics.jsonl.

    python -m gspo_mcore.plot OUTPUT_DIR [OTHER_OUTPUT_DIR ...] [--out DIR] [--labels a,b]

One figure per quantity (reward, clip fraction, response length, train-inference mismatch,
step-time breakdown), each run a line (e.g. GSPO vs GRPO on the same task). Written to
--out (default: the first run's OUTPUT_DIR/plots).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gspo_mcore.errors import InputError, run_cli
from gspo_mcore.files import atomic_output

FIGURES = {
    "reward": ("reward_mean", "mean reward"),
    "clip_fraction": ("clip_fraction", "clipped share of response tokens"),
    "response_length": ("response_length_mean", "mean response length (tokens)"),
    "mismatch": ("mismatch_abs_log_ratio_mean", "|log ratio| on the on-policy minibatch (engine vs trainer)"),
}
TIMES = ("time_rollout_s", "time_train_s", "time_sync_s")


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


def plot_runs(run_dirs: list[Path], out_dir: Path, labels: list[str] | None = None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [read_metrics(d) for d in run_dirs]
    labels = labels or [Path(d).name for d in run_dirs]
    if len(labels) != len(runs):
        raise InputError(f"--labels: {len(labels)} labels for {len(runs)} runs")
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (key, title) in FIGURES.items():
        fig, ax = plt.subplots(figsize=(7, 4))
        for label, rows in zip(labels, runs):
            points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            if points:
                ax.plot(*zip(*points), label=label)
        ax.set_xlabel("step")
        ax.set_title(title)
        if name == "mismatch":
            ax.set_yscale("symlog", linthresh=1e-7)
        ax.legend()
        ax.grid(alpha=0.3)
        written.append(_save(fig, out_dir / f"{name}.png"))
    fig, axes = plt.subplots(1, len(runs), figsize=(7 * len(runs), 4), squeeze=False)
    for ax, label, rows in zip(axes[0], labels, runs):
        steps = [r["step"] for r in rows]
        ax.stackplot(steps, *[[r.get(k, 0.0) for r in rows] for k in TIMES],
                     labels=[k.removeprefix("time_").removesuffix("_s") for k in TIMES])
        ax.set_title(f"{label}: step time (s)")
        ax.set_xlabel("step")
        ax.legend(loc="upper left")
    written.append(_save(fig, out_dir / "step_time.png"))
    return written


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    with atomic_output(path) as tmp:
        fig.savefig(tmp, dpi=100, format="png")  # the temporary's name has no .png to go by
    plt.close(fig)
    return path


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m gspo_mcore.plot", description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--labels", default=None, help="comma-separated, one per run")
    args = parser.parse_args(argv)
    out = args.out or args.runs[0] / "plots"
    for path in plot_runs(args.runs, out, args.labels.split(",") if args.labels else None):
        print(path)


if __name__ == "__main__":
    sys.exit(run_cli(main))
