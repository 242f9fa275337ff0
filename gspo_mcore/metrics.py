"""What a run reports: the loss's metrics combined exactly, router load, metrics.jsonl +
TensorBoard, and the progress line."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch

from gspo_mcore.loss import METRIC_KINDS

_WEIGHTS = {"tokens": "num_tokens", "sequences": "num_sequences"}


def combine(parts: list[dict[str, float]], kinds: dict[str, str] = METRIC_KINDS) -> dict[str, float]:
    """Per-microbatch metrics (any split of one minibatch over microbatches and ranks) -> the
    minibatch's: weighted means by each part's token / sequence count, extremes, sums. A mean
    with no weight anywhere is None (nothing measured). Keys not in `kinds` are summed
    (the loss's share of the global loss, the KL term)."""
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for part in parts for k in part):
        kind = kinds.get(key, "sum")
        values = [p[key] for p in parts if key in p]
        if kind == "sum":
            out[key] = sum(values)
        elif kind in ("min", "max"):
            weights = [p["num_sequences"] for p in parts if key in p]
            present = [v for v, w in zip(values, weights) if w > 0]
            out[key] = (min if kind == "min" else max)(present) if present else None
        else:
            weights = [p[_WEIGHTS[kind]] for p in parts if key in p]
            total = sum(weights)
            out[key] = sum(v * w for v, w in zip(values, weights)) / total if total > 0 else None
    return out


def update_report(by_step: list[list[dict[str, float]]], grad_norms: list[float]) -> dict:
    """A rollout batch's update figures from the loss's per-microbatch metrics (`by_step`: per
    optimizer step, every microbatch of every data-parallel rank). Ratios, clip fractions and
    entropy over all steps; the loss and KL per step (mean); the train-inference mismatch from
    the first step, where theta = theta_old so the ratio is the engine/trainer difference alone."""
    overall = combine([part for step in by_step for part in step])
    first = combine(by_step[0])
    out = {key: overall.get(key) for key in ("clip_fraction", "clip_fraction_low", "clip_fraction_high",
                                             "clip_fraction_sequences", "ratio_mean", "ratio_min", "ratio_max",
                                             "entropy", "kl", "token_mask_fraction", "sequence_mask_fraction",
                                             "clip_band_high")
           if key in overall}
    out["loss"] = overall["loss"] / len(by_step)
    if "kl" in out:
        out["kl"] /= len(by_step)
    out.update(
        mismatch_abs_log_ratio_mean=first.get("mismatch_seq"),
        mismatch_abs_log_ratio_max=first.get("mismatch_seq_max"),
        mismatch_token_abs_log_ratio_mean=first.get("mismatch_token"),
        mismatch_out_of_band_fraction=first.get("mismatch_out_of_band"),
        grad_norm=sum(grad_norms) / len(grad_norms),
    )
    return out


def to_floats(metrics: dict[str, torch.Tensor]) -> dict[str, float]:
    """One device-to-host copy for a microbatch's tensor metrics."""
    keys = list(metrics)
    values = torch.stack([metrics[k].detach().double().reshape(()) for k in keys]).cpu().tolist()
    return dict(zip(keys, values))


class RouterLoad:
    """Tokens per expert per layer, counted by hooks on the routers during training forwards."""

    def __init__(self, model, num_layers: int, num_experts: int):
        from gspo_mcore.parallel import device

        # On device(): a per-layer .cpu() in the hook would synchronise the GPU every forward.
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.float64, device=device())
        for layer in model.decoder.layers:
            router = getattr(getattr(layer, "mlp", None), "router", None)
            if router is not None:
                router.register_forward_hook(self._hook(layer.layer_number - 1))

    def _hook(self, index: int):
        def hook(module, inputs, output):
            if module.training:
                routing_map = output[1]  # [tokens, experts] bool
                self.counts[index] += routing_map.detach().sum(0).double()
        return hook

    def reset(self) -> None:
        self.counts.zero_()

    def imbalance(self) -> list[float]:
        """Per MoE layer, max expert load / mean load over all ranks' tokens (1 = balanced). Collective."""
        import torch.distributed as dist

        counts = self.counts.clone()
        dist.all_reduce(counts)
        return [(row.max() / row.mean()).item() for row in counts if row.sum() > 0]


def _scalars(metrics: dict):
    for key, value in metrics.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            yield key, float(value)
        elif isinstance(value, list):  # per-layer figures
            for i, item in enumerate(value):
                if item is not None:
                    yield f"{key}/layer_{i}", float(item)


class RunLog:
    """OUTPUT_DIR/metrics.jsonl (one object per step, appended and flushed) and TensorBoard
    event files in OUTPUT_DIR/tensorboard. A run resumed from step N first drops what a killed
    run logged past N (those steps are trained again), in both."""

    def __init__(self, output_dir: Path, start_step: int = 0):
        from torch.utils.tensorboard import SummaryWriter

        from gspo_mcore.files import atomic_output

        path = Path(output_dir) / "metrics.jsonl"
        if start_step and path.is_file():
            kept = [line for line in path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= start_step]
            with atomic_output(path) as tmp:
                tmp.write_text("".join(line + "\n" for line in kept))
        self.file = open(path, "a")
        self.tensorboard = SummaryWriter(str(Path(output_dir) / "tensorboard"),
                                         purge_step=start_step + 1 if start_step else None)

    def write(self, metrics: dict) -> None:
        self.file.write(json.dumps(metrics) + "\n")
        self.file.flush()
        for key, value in _scalars(metrics):
            if key != "step":
                self.tensorboard.add_scalar(key, value, metrics["step"])
        self.tensorboard.flush()

    def close(self) -> None:
        self.file.close()
        self.tensorboard.close()


class Progress:
    """One line per step: a bar, the step's figures, and the ETA."""

    def __init__(self, total: int, start: int = 0, stream=sys.stdout):
        self.total, self.start, self.stream = total, start, stream
        self.began = time.monotonic()

    def update(self, m: dict) -> None:
        m = {k: (float("nan") if v is None else v) for k, v in m.items()}
        done = m["step"]
        width = 20
        bar = "#" * round(width * done / self.total) + "-" * (width - round(width * done / self.total))
        per_step = (time.monotonic() - self.began) / max(1, done - self.start)
        eta = per_step * (self.total - done)
        self.stream.write(
            f"step {done:>4}/{self.total} [{bar}] reward {m['reward_mean']:.3f}±{m['reward_std']:.3f} "
            f"clip {m['clip_fraction']:.3f} mismatch {m['mismatch_abs_log_ratio_mean']:.1e} "
            f"len {m['response_length_mean']:.1f} | {m['tokens_per_s']:.0f} tok/s | rollout {m['time_rollout_s']:.1f}s "
            f"train {m['time_train_s']:.1f}s sync {m['time_sync_s']:.1f}s | ETA {int(eta) // 60}m{int(eta) % 60:02d}s\n"
        )
        self.stream.flush()
