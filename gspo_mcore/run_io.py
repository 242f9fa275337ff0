"""What a run leaves on disk and prints: checkpoints, metrics.jsonl + TensorBoard, progress."""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from gspo_mcore.errors import CheckpointError


class TrainState:
    """Megatron distributed checkpoints (model + optimizer + RNG states) with the step and the
    data position, under OUTPUT_DIR/checkpoints/step_NNNNNN. Written to a temporary directory
    and renamed; `latest` is replaced atomically afterwards, so a kill during a save leaves the
    previous checkpoint as the one a resume takes."""

    def __init__(self, output_dir: Path):
        self.root = Path(output_dir) / "checkpoints"

    def _sharded(self, ddp, optimizer, loading: bool) -> dict:
        model_sd = ddp.module.sharded_state_dict()
        # dp_reshardable: Megatron-LM's default; megatron-core 0.16.1's own default
        # (fully_sharded_model_space) fails with "flattened_range is not supported".
        metadata = {"distrib_optim_sharding_type": "dp_reshardable"}
        return {"model": model_sd,
                "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=loading, metadata=metadata),
                "rng_state": _rng_state()}

    def save(self, ddp, optimizer, step: int, extra: dict) -> Path:
        from megatron.core import dist_checkpointing

        path = self.root / f"step_{step:06d}"
        tmp = path.with_name(path.name + ".tmp")
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        dist_checkpointing.save(self._sharded(ddp, optimizer, loading=False), str(tmp))
        dist.barrier()
        if dist.get_rank() == 0:
            (tmp / "trainer_state.json").write_text(json.dumps({"step": step, **extra}))
            shutil.rmtree(path, ignore_errors=True)
            tmp.rename(path)
            latest = self.root / "latest.tmp"
            latest.write_text(path.name)
            os.replace(latest, self.root / "latest")
        dist.barrier()
        return path

    def latest(self) -> Path:
        pointer = self.root / "latest"
        if not pointer.is_file():
            raise CheckpointError(f"{pointer}: no checkpoint to resume from")
        path = self.root / pointer.read_text().strip()
        if not (path / "trainer_state.json").is_file():
            raise CheckpointError(f"{path}: incomplete checkpoint (no trainer_state.json)")
        return path

    def load(self, ddp, optimizer) -> tuple[int, dict]:
        from megatron.core import dist_checkpointing

        path = self.latest()
        _init_optimizer_states(optimizer)
        sharded = self._sharded(ddp, optimizer, loading=True)
        loaded = dist_checkpointing.load(sharded, str(path))
        ddp.module.load_state_dict(loaded["model"])
        _set_rng_state(loaded["rng_state"])
        with torch.no_grad():  # float32 main params are views of the model's leaf parameters
            optimizer.load_state_dict(loaded["optimizer"])
        _restore_adam_steps(optimizer, loaded["optimizer"])
        state = json.loads((path / "trainer_state.json").read_text())
        return state.pop("step"), state


def _rng_state():
    """This rank's random states (torch, CUDA, Megatron's model-parallel tracker), one
    entry per rank as Megatron-LM saves them."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {"torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states(),
             "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}
    world, rank = dist.get_world_size(), dist.get_rank()
    return ShardedObject("rng_state", state, (world,), (rank,), replica_id=0)


def _set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"])


def _init_optimizer_states(optimizer) -> None:
    """Give a fresh optimizer its per-parameter states (one step on zero gradients; the load
    then overwrites them). Without them megatron-core 0.16.1's distributed optimizer cannot
    describe its checkpoint when neither Apex nor Transformer Engine is installed
    (`assert len(steps) == 1` on an empty state)."""
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = chained.optimizer
        if inner.state:
            continue
        for group in inner.param_groups:
            for param in group["params"]:
                param.grad = torch.zeros_like(param)
        inner.step()
        inner.zero_grad()


def _restore_adam_steps(optimizer, loaded: dict) -> None:
    """The loaded Adam step count (bias correction) per chained optimizer. Measured with
    megatron-core 0.16.1 (no Apex/TE, dp_reshardable): after load_state_dict the per-parameter
    `step` was the placeholder's, not the checkpoint's; the resume test compares re-saved
    checkpoints bitwise, so this is checked. Only torch's Adam keeps `step` per parameter:
    Transformer Engine's / Apex's FusedAdam keep it in the param groups (and refuse a state
    key they do not know), the host-offload optimizer restores its own."""
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    parts = [loaded] if len(chained) == 1 else [loaded[i] for i in range(len(chained))]
    for opt, part in zip(chained, parts):
        if not isinstance(opt.optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        steps = {g.get("step") for g in part["optimizer"]["param_groups"]} - {None}
        if len(steps) == 1:
            step = torch.tensor(float(steps.pop()))
            for state in opt.optimizer.state.values():
                state["step"] = step.clone()


def _scalars(metrics: dict):
    for key, value in metrics.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            yield key, float(value)
        elif isinstance(value, list):  # per-layer figures
            for i, item in enumerate(value):
                yield f"{key}/layer_{i}", float(item)


class RunLog:
    """OUTPUT_DIR/metrics.jsonl (one object per step, appended and flushed) and TensorBoard
    event files in OUTPUT_DIR/tensorboard."""

    def __init__(self, output_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.file = open(Path(output_dir) / "metrics.jsonl", "a")
        self.tensorboard = SummaryWriter(str(Path(output_dir) / "tensorboard"))

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
