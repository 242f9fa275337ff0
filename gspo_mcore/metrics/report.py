"""What a run reports (rows of gspo_mcore.metrics.schema): the loss's metrics combined exactly,
the sinks (metrics.jsonl, TensorBoard, Weights & Biases), and the progress line."""

from __future__ import annotations

import json
import math
import re
import secrets
import sys
import time
from pathlib import Path

import torch
from torch.utils.tensorboard import SummaryWriter

from gspo_mcore.common.errors import InputError
from gspo_mcore.common.files import atomic_output
from gspo_mcore.metrics.schema import HISTOGRAMS, LOSS_METRICS, SCHEMA, combine_kinds, unknown

PRINTED = tuple(m for m in SCHEMA if m.printed)

def combine(parts: list[dict[str, float]], kinds: dict[str, tuple[str, str]] | None = None) -> dict[str, float]:
    """Per-microbatch metrics (any split of one minibatch over microbatches and ranks) -> the
    minibatch's: means weighted by each part's count, extremes over the parts that count
    something, sums (kinds: name -> (kind, count), the schema's). A mean or extreme with no
    count anywhere is None (nothing measured)."""
    kinds = kinds or combine_kinds()
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for part in parts for k in part):
        kind, count = kinds[key]
        values = [p[key] for p in parts if key in p]
        if kind == "sum":
            out[key] = sum(values)
        elif kind in ("min", "max"):
            weights = [p[count] for p in parts if key in p]
            present = [v for v, w in zip(values, weights) if w > 0]
            out[key] = (min if kind == "min" else max)(present) if present else None
        else:
            weights = [p[count] for p in parts if key in p]
            total = sum(weights)
            out[key] = sum(v * w for v, w in zip(values, weights)) / total if total > 0 else None
    return out


def update_report(by_step: list[list[dict[str, float]]]) -> dict:
    """A rollout batch's loss figures from the per-microbatch metrics (`by_step`: per optimizer
    step, every microbatch of every data-parallel rank), each by its schema row's scope: over all
    steps, from the first (theta = theta_old), or per step. Every loss row is present; None when
    not measured (a term that is off)."""
    overall = combine([part for step in by_step for part in step])
    first = combine(by_step[0])
    out = {}
    for metric in LOSS_METRICS:
        value = (first if metric.scope == "first" else overall).get(metric.name)
        out[metric.name] = value / len(by_step) if metric.scope == "per_step" and value is not None else value
    return out


def to_floats(metrics: dict[str, torch.Tensor]) -> dict[str, float]:
    """A microbatch's tensor metrics as floats, in one device-to-host copy."""
    return all_to_floats([metrics])[0]


def all_to_floats(microbatches: list[dict[str, torch.Tensor]]) -> list[dict[str, float]]:
    """Every microbatch's tensor metrics as floats, in one device-to-host copy for the update (on a
    GPU each copy is a host wait)."""
    keys = [list(metrics) for metrics in microbatches]
    scalars = [metrics[k].detach().double().reshape(()) for metrics, names in zip(microbatches, keys) for k in names]
    values = iter(torch.stack(scalars).cpu().tolist() if scalars else [])
    return [{k: next(values) for k in names} for names in keys]


def _scalars(metrics: dict):
    for key, value in metrics.items():
        if key in HISTOGRAMS:
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            yield key, float(value)
        elif isinstance(value, list):  # per-layer figures
            for i, item in enumerate(value):
                if item is not None:
                    yield f"{key}/layer_{i}", float(item)


def _unit_bins(n: int):
    """Bin edges -0.5, 0.5, ..., n - 0.5: one bin per integer value 0..n-1."""
    return torch.arange(n + 1, dtype=torch.float64).sub(0.5).numpy()  # host: numpy bins


def _drop_after(path: Path, step: int) -> None:
    """A resumed run's log without what a killed run logged past `step` (trained again)."""
    if path.is_file():
        kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line).get("step", 0) <= step]
        with atomic_output(path) as tmp:
            tmp.write_text("".join(line + "\n" for line in kept))


class RunLog:
    """Every sink of a run's metrics, all fed the same schema-checked rows: OUTPUT_DIR/metrics.jsonl
    (one object per step, appended and flushed), TensorBoard event files in OUTPUT_DIR/tensorboard,
    and Weights & Biases when `wandb_project` is set (WANDB_MODE=offline works without a network;
    the run id is kept in OUTPUT_DIR/wandb_run_id so a resumed run continues the same W&B run).
    A run resumed from step N first drops what a killed run logged past N (those steps are
    trained again) from metrics.jsonl and TensorBoard; W&B keeps its first record of a step."""

    def __init__(self, output_dir: Path, start_step: int = 0, wandb_project: str | None = None,
                 run_config: dict | None = None):
        output_dir = Path(output_dir)
        path = output_dir / "metrics.jsonl"
        if start_step:
            for log in (path, output_dir / "eval.jsonl"):
                _drop_after(log, start_step)
        self.file = open(path, "a")
        self.eval_file = open(output_dir / "eval.jsonl", "a")
        self.tensorboard = SummaryWriter(str(output_dir / "tensorboard"),
                                         purge_step=start_step + 1 if start_step else None)
        self.wandb = _wandb_run(output_dir, wandb_project, start_step, run_config) if wandb_project else None

    def write(self, metrics: dict) -> None:
        if unknown(metrics):  # a bug: every reported figure has a row in metric_schema
            raise KeyError(f"metrics not in gspo_mcore.metrics.schema: {unknown(metrics)}")
        self.file.write(json.dumps(metrics) + "\n")
        self.file.flush()
        # Evaluation figures reach TensorBoard / W&B by write_eval (the one before training too).
        scalars = {key: value for key, value in _scalars(metrics) if key != "step" and not key.startswith("eval/")}
        for key, value in scalars.items():
            self.tensorboard.add_scalar(key, value, metrics["step"])
        histograms = {key: metrics[key] for key in HISTOGRAMS if metrics.get(key)}
        for key, counts in histograms.items():  # counts of the values 0, 1, ...: one bin each
            values = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))  # host: for the writer
            self.tensorboard.add_histogram(key, values, metrics["step"], bins=_unit_bins(len(counts)))
        self.tensorboard.flush()
        if self.wandb is not None:
            import wandb

            self.wandb.log({**scalars, **{key: wandb.Histogram(np_histogram=(counts, _unit_bins(len(counts)).tolist()))
                                          for key, counts in histograms.items()}}, step=metrics["step"])

    def write_eval(self, step: int, version: str, metrics: dict) -> None:
        """An evaluation of the weights `version` after `step` steps (0: before training):
        OUTPUT_DIR/eval.jsonl and TensorBoard (a trained step's row carries them too)."""
        if unknown(metrics):
            raise KeyError(f"metrics not in gspo_mcore.metrics.schema: {unknown(metrics)}")
        self.eval_file.write(json.dumps({"step": step, "version": version, **metrics}) + "\n")
        self.eval_file.flush()
        for key, value in metrics.items():
            self.tensorboard.add_scalar(key, value, step)
        self.tensorboard.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def close(self) -> None:
        self.file.close()
        self.eval_file.close()
        self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


def _wandb_run(output_dir: Path, project: str, start_step: int, run_config: dict | None):
    """A W&B run logging to `project`, resumed (same id) when this output directory had one."""
    try:
        import wandb  # optional: only runs that set train.wandb_project need it
    except ImportError:
        raise InputError("train.wandb_project: the wandb package is not installed (pip install wandb)") from None
    id_file = output_dir / "wandb_run_id"
    run_id = id_file.read_text().strip() if start_step and id_file.is_file() else secrets.token_hex(4)
    run = wandb.init(project=project, id=run_id, name=output_dir.name, dir=str(output_dir), config=run_config,
                     resume="allow")
    id_file.write_text(run_id)
    return run


def _unmeasured(printed: str) -> str:
    """A printed figure's format with its value (and unit) as "-": "mismatch {:.1e}" -> "mismatch -"."""
    return re.sub(r"\{[^}]*\}\S*", "-", printed)


class Progress:
    """One line per step: a bar, the schema's printed figures, and the ETA. A figure never
    measured in this run (staleness in sync mode, turns in a single-turn run) is left out; one
    measured before but not on this step (a step that trained nothing) reads "-", so the columns
    stay where they were."""

    def __init__(self, total: int, start: int = 0, stream=None):
        # None: the sys.stdout of the moment, not the one at import (replaced by then under pytest's capture)
        self.total, self.start, self.stream = total, start, stream or sys.stdout
        self.began = time.monotonic()
        self.seen: set[str] = set()

    def update(self, m: dict) -> None:
        done = m["step"]
        width = 20
        bar = "#" * round(width * done / self.total) + "-" * (width - round(width * done / self.total))
        per_step = (time.monotonic() - self.began) / max(1, done - self.start)
        eta = per_step * (self.total - done)
        self.seen |= {metric.name for metric in PRINTED if m.get(metric.name) is not None
                      and not metric.printed_if_nonzero}
        figures = " ".join(metric.printed.format(m[metric.name]) if m.get(metric.name) is not None
                           else _unmeasured(metric.printed) for metric in PRINTED if metric.name in self.seen)
        figures += "".join(f" {metric.printed.format(m[metric.name])}" for metric in PRINTED
                           if metric.printed_if_nonzero and m.get(metric.name))
        figures += "".join(f" | {k} {v:.3f}" for k, v in m.items() if k.startswith("eval/") and "/mean@" in k)
        self.stream.write(f"step {done:>4}/{self.total} [{bar}] {figures} | ETA {int(eta) // 60}m{int(eta) % 60:02d}s\n")
        self.stream.flush()
