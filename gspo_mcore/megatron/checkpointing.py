"""Every checkpoint a run reads or writes: Megatron-Core distributed checkpoints (torch_dist) of the
model's initial weights and of a run's training state (save, resume, retention), and the
Hugging Face export of the trainer's weights (the final `OUTPUT_DIR/hf`, and weight sync's disk path)."""

from __future__ import annotations

import json
import math
import queue
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

from gspo_mcore.common.errors import CheckpointError

# Megatron's modules are imported in the functions that use them: the converter imports this
# module for its checkpoint names and starts without Megatron (heavy, and it warns at import).
from gspo_mcore.common.files import LATEST, atomic_output, atomic_output_all_ranks
from gspo_mcore.common.safetensors_io import HFCheckpointWriter, copy_side_files, write_index_file

RELEASE = "release"
TRACKER = "latest_checkpointed_iteration.txt"


def keep_writer_results_in_process() -> None:
    """Megatron's torch_dist writer takes its results queue from a multiprocessing Manager that it
    spawns at the first save (dist_checkpointing/strategies/filesystem_async.py,
    _get_write_results_queue): a process that re-imports the trainer (seconds), outlived a
    SIGKILLed trainer, and died of the terminal's Ctrl-C while starting (an EOFError in the
    save). Our saves are synchronous (AsyncRequest.execute_sync in strategies/async_utils.py: the
    writer's results are put and taken in this process), so a plain in-process queue serves, and
    no process is started."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def hide_sharded_tensor_deprecation() -> None:
    """torch warns at every ShardedTensor it builds (torch/distributed/_shard/sharded_tensor) that it will
    be replaced by DTensor: megatron-core 0.16.1's torch_dist loads build them, so every --resume
    and `checkpoint_convert verify` printed it; nothing a user can act on."""
    import warnings

    warnings.filterwarnings("ignore", message="Please use DTensor instead and we are deprecating ShardedTensor",
                            category=FutureWarning)


def latest_checkpoint(output_dir: Path) -> Path:
    """The run's newest complete checkpoint (what --resume loads); CheckpointError if none."""
    root = Path(output_dir) / "checkpoints"
    pointer = root / LATEST
    if not pointer.is_file():
        raise CheckpointError(f"{pointer}: no checkpoint to resume from")
    path = root / pointer.read_text().strip()
    if not (path / "trainer_state.json").is_file():
        raise CheckpointError(f"{path}: incomplete checkpoint (no trainer_state.json)")
    return path


def checkpoint_step(checkpoint: Path) -> int:
    """The steps a run's checkpoint (latest_checkpoint's) has completed: its trainer_state.json's `step`."""
    return json.loads((Path(checkpoint) / "trainer_state.json").read_text())["step"]


def checkpoint_dir(path) -> Path:
    """The directory holding `.metadata`: given either it, a Megatron-LM save root whose
    latest_checkpointed_iteration.txt names `release` or an iteration, or a run's save root
    (OUTPUT_DIR/checkpoints, or OUTPUT_DIR) whose `latest` names a step."""
    path = Path(path)
    if (path / ".metadata").is_file():
        return path
    if (path / "checkpoints" / LATEST).is_file():
        path = path / "checkpoints"
    if (path / LATEST).is_file():
        step = path / (path / LATEST).read_text(errors="replace").strip()
        if not (step / ".metadata").is_file():
            raise CheckpointError(f"{path / LATEST}: names {step.name!r}, which holds no checkpoint (.metadata)")
        return step
    tracker = path / TRACKER
    if not tracker.is_file():
        raise CheckpointError(f"{path}: neither a checkpoint (.metadata) nor a save root ({TRACKER}, or a "
                              f"run's checkpoints/{LATEST})")
    it = tracker.read_text(errors="replace").strip()
    if it != RELEASE and not it.isdigit():
        raise CheckpointError(f"{tracker}: expected an iteration number or {RELEASE!r}, found {it[:40]!r}")
    return path / (RELEASE if it == RELEASE else f"iter_{int(it):07d}")


def load_model_weights(model, path) -> None:
    """Fill `model` (an unwrapped GPTModel, any TP/PP/EP layout) from a torch_dist checkpoint."""
    from megatron.core import dist_checkpointing

    sharded = model.sharded_state_dict()
    loaded = dist_checkpointing.load(sharded, str(checkpoint_dir(path)))  # also holds common.pt's entries
    model.load_state_dict({key: loaded[key] for key in sharded})


class Stateful(Protocol):
    """A part of training that a checkpoint holds, registered by name (torchtitan's Stateful).
    Its state is trainer_state.json's entry under its name, written by rank 0: JSON values (the
    step, the data position, the schedule). A part that is not the same on every rank (tensors,
    sharded) has `sharded_state_dict` instead (MegatronState)."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None:
        """`state`: the checkpoint's entry, None when it has none (saved before the part existed)."""


@dataclass
class TrainState:
    """The trainer's own state: the steps completed (trainer_state.json's `step`)."""

    step: int = 0

    def state_dict(self) -> int:
        return self.step

    def load_state_dict(self, step: int) -> None:
        self.step = step


@dataclass
class FunctionState:
    """A Stateful of two functions, for a part that is no object of its own."""

    state_dict: Callable[[], Any]
    load_state_dict: Callable[[Any], None]


class MegatronState:
    """The model, the optimizer and each rank's RNG states: one Megatron distributed checkpoint
    (torch_dist, collective). Its entries are the checkpoint's top-level keys `model`,
    `optimizer`, `rng_state`, as Megatron-LM saves them."""

    def __init__(self, ddp, optimizer):
        self.ddp, self.optimizer = ddp, optimizer

    def sharded_state_dict(self, is_loading: bool) -> dict:
        # A run that trained nothing (every group without signal) has no optimizer state to
        # describe: give it neutral ones (zero moments, step 0), leaving the weights as they are;
        # a load overwrites the placeholders.
        _init_optimizer_states(self.optimizer, neutral=not is_loading)
        model_sd = self.ddp.module.sharded_state_dict()
        # dp_reshardable: Megatron-LM's default; megatron-core 0.16.1's own default
        # (fully_sharded_model_space) fails with "flattened_range is not supported".
        metadata = {"distrib_optim_sharding_type": "dp_reshardable"}
        return {"model": model_sd,
                "optimizer": self.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata),
                "rng_state": _rng_state()}

    def load_state_dict(self, loaded: dict) -> None:
        self.ddp.module.load_state_dict(loaded["model"])
        _set_rng_state(loaded["rng_state"])
        with torch.no_grad():  # float32 main params are views of the model's leaf parameters
            self.optimizer.load_state_dict(loaded["optimizer"])
        _restore_adam_steps(self.optimizer, loaded["optimizer"])


class SchedulerState:
    """The learning-rate schedule (Megatron's OptimizerParamScheduler); loaded after the optimizer
    (registered after MegatronState): the schedule, the config's lr, sets the lr."""

    def __init__(self, scheduler, optimizer, train_state: TrainState):
        self.scheduler, self.optimizer, self.train_state = scheduler, optimizer, train_state

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict | None) -> None:
        # The loaded param groups carry the saved run's bounds, which OptimizerParamScheduler.get_lr
        # prefers to its own: the config's (the scheduler's) take their place.
        for group in self.optimizer.param_groups:
            group["max_lr"], group["min_lr"] = self.scheduler.max_lr, self.scheduler.min_lr
        if state:
            self.scheduler.load_state_dict(state)
        else:  # a checkpoint from before schedules: one scheduler step per training step
            self.scheduler.step(self.train_state.step)


class Checkpointer:
    """A run's checkpoints: whatever registers with it (`register(name, part)`), each part saved
    and loaded through its own state_dict / load_state_dict (torchtitan's CheckpointManager and
    its `states`). Sharded parts (MegatronState) go into one Megatron distributed checkpoint,
    the others into trainer_state.json under their names, with the step (`train_state`, registered
    as `step`), under OUTPUT_DIR/checkpoints/step_NNNNNN. Written to a temporary directory and
    renamed; `latest` is replaced atomically afterwards, so a kill during a save leaves the
    previous checkpoint as the one a resume takes. Only the newest `keep` are kept (one 30B-A3B
    checkpoint with Adam states is ~400 GB): older ones go once a newer one is complete and
    `latest` names it. Parts load in the order they registered, sharded ones first."""

    def __init__(self, output_dir: Path, model, keep: int = 0):
        self.output_dir = Path(output_dir)
        self.root = self.output_dir / "checkpoints"
        self.model, self.keep = model, keep  # model: the GPTModel the HF export writes
        self.train_state = TrainState()
        self.states: dict[str, Stateful] = {}
        self.register("step", self.train_state)

    def register(self, name: str, part) -> None:
        """Save and load `part` under `name`. A part only some ranks hold (rank 0's rollout state)
        registers on those: trainer_state.json is rank 0's."""
        if name in self.states:
            raise ValueError(f"checkpoint part {name!r}: registered twice")
        self.states[name] = part

    def _sharded(self) -> dict[str, object]:
        return {name: part for name, part in self.states.items() if hasattr(part, "sharded_state_dict")}

    def export_hf(self, arch, spec: str, hf_config_dir) -> Path:
        """The model's weights as a Hugging Face checkpoint in OUTPUT_DIR/hf (what SGLang,
        transformers and `gspo-eval` load). Collective."""
        return save_hf_checkpoint(self.model, arch, spec, self.output_dir / "hf", hf_config_dir)

    def _sharded_state_dicts(self, is_loading: bool) -> dict[str, dict]:
        """Each sharded part's entries; together the checkpoint's top-level keys (none may repeat)."""
        parts, keys = {}, set()
        for name, part in self._sharded().items():
            parts[name] = part.sharded_state_dict(is_loading=is_loading)
            if keys & parts[name].keys():
                raise ValueError(f"checkpoint part {name!r}: entries {sorted(keys & parts[name].keys())} "
                                 "are another part's")
            keys |= parts[name].keys()
        return parts

    def save(self, step: int) -> Path:
        """Collective: every registered part at `step` completed steps."""
        from megatron.core import dist_checkpointing

        keep_writer_results_in_process()
        self.train_state.step = step
        path = self.root / f"step_{step:06d}"
        with atomic_output_all_ranks(path) as tmp:
            sharded = self._sharded_state_dicts(is_loading=False)
            if sharded:
                dist_checkpointing.save({k: v for entries in sharded.values() for k, v in entries.items()}, str(tmp))
            if dist.get_rank() == 0:  # last: the file marks a complete checkpoint
                (tmp / "trainer_state.json").write_text(json.dumps(
                    {name: part.state_dict() for name, part in self.states.items() if name not in sharded}))
        if dist.get_rank() == 0:
            with atomic_output(self.root / LATEST) as latest:
                latest.write_text(path.name)
            self._prune(path)
        dist.barrier()
        return path

    def _prune(self, latest: Path) -> None:
        if self.keep < 1:
            return
        complete = sorted(p for p in self.root.glob("step_*") if p.is_dir() and (p / "trainer_state.json").is_file())
        for old in complete[: max(0, len(complete) - self.keep)]:
            if old != latest:
                shutil.rmtree(old, ignore_errors=True)

    def latest(self) -> Path:
        return latest_checkpoint(self.output_dir)

    def load(self) -> int:
        """Every registered part from the latest checkpoint; its step. Collective."""
        from megatron.core import dist_checkpointing

        path = self.latest()
        sharded = self._sharded_state_dicts(is_loading=True)
        if sharded:
            loaded = dist_checkpointing.load({k: v for entries in sharded.values() for k, v in entries.items()},
                                             str(path))
            for name, entries in sharded.items():
                self.states[name].load_state_dict({key: loaded[key] for key in entries})
        state = json.loads((path / "trainer_state.json").read_text())
        for name, part in self.states.items():
            if name not in sharded:
                part.load_state_dict(state.get(name))
        return self.train_state.step


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


def _init_optimizer_states(optimizer, neutral: bool = False) -> None:
    """Give a fresh optimizer its per-parameter states (one step on zero gradients with lr
    and weight decay 0, so the weights do not move; a load then overwrites them). Without them
    megatron-core 0.16.1's distributed optimizer cannot describe its checkpoint when neither
    Apex nor Transformer Engine is installed (`assert len(steps) == 1` on an empty state).
    `neutral`: the step count back to 0, as if no step had been taken."""
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = chained.optimizer
        if inner.state:
            continue
        saved = [(group["lr"], group.get("weight_decay", 0.0)) for group in inner.param_groups]
        for group in inner.param_groups:
            group["lr"], group["weight_decay"] = 0.0, 0.0
            for param in group["params"]:
                param.grad = torch.zeros_like(param)
        inner.step()
        inner.zero_grad()
        for group, (lr, decay) in zip(inner.param_groups, saved):
            group["lr"], group["weight_decay"] = lr, decay
        if neutral:
            for state in inner.state.values():
                if "step" in state:
                    state["step"] = torch.zeros_like(torch.as_tensor(state["step"], dtype=torch.float32))


def _restore_adam_steps(optimizer, loaded: dict) -> None:
    """The loaded Adam step count (bias correction) per chained optimizer. Measured with
    megatron-core 0.16.1 (no Apex/TE, dp_reshardable): after load_state_dict the per-parameter
    `step` was the placeholder's, not the checkpoint's; the resume test compares re-saved
    checkpoints bitwise, so this is checked. Only torch's Adam keeps `step` per parameter:
    Transformer Engine's / Apex's FusedAdam keep it in the param groups (and refuse a state
    key they do not know), the host-offload optimizer restores its own."""
    from gspo_mcore.megatron.optimizer import steps_on_param_devices

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
            steps_on_param_devices(opt.optimizer)  # a fused step reads it on the device


def save_hf_checkpoint(model, arch, spec: str, out_dir, hf_config_dir) -> Path:
    """Write the trainer's current weights as a Hugging Face checkpoint (safetensors shards
    + index + the config/tokenizer files of `hf_config_dir`), each rank writing the tensors it
    owns, streamed. Collective. Written to a temporary sibling and renamed when complete;
    the disk path of weight sync (`/update_weights_from_disk`) and the run's final export."""
    out_dir = Path(out_dir)
    with atomic_output_all_ranks(out_dir) as tmp:
        _write_hf_checkpoint(model, arch, spec, tmp, hf_config_dir)
    return out_dir


def _write_hf_checkpoint(model, arch, spec: str, tmp: Path, hf_config_dir) -> None:
    # Heavy (Megatron's model and optimizer modules): the converter imports this module for its
    # checkpoint names and must start without them.
    from gspo_mcore.megatron.qwen3_moe.parallel_weights import owned_hf_plan, owned_hf_weights

    rank = dist.get_rank()
    plan = owned_hf_plan(model, arch, spec)
    counts = [None] * dist.get_world_size()
    dist.all_gather_object(counts, HFCheckpointWriter(tmp, plan).num_shards)
    writer = HFCheckpointWriter(tmp, plan, first_shard=sum(counts[:rank]), total_shards=sum(counts))
    for name, tensor in owned_hf_weights(model, arch, spec):
        writer.write(name, tensor)
    writer.finish(write_index=False)
    maps = [None] * dist.get_world_size()
    dist.all_gather_object(maps, (writer.weight_map, sum(t.itemsize * math.prod(s) for _, t, s in plan)))
    if rank == 0:
        write_index_file(tmp, {k: v for m, _ in maps for k, v in m.items()}, sum(size for _, size in maps))
        copy_side_files(hf_config_dir, tmp)
