"""Megatron-Core distributed checkpoints (torch_dist) of the model: where they are, loading."""

from __future__ import annotations

from pathlib import Path

from gspo_mcore.errors import CheckpointError

RELEASE = "release"
TRACKER = "latest_checkpointed_iteration.txt"


def checkpoint_dir(path) -> Path:
    """The directory holding `.metadata`: given either it, or a Megatron-LM save root
    whose latest_checkpointed_iteration.txt names `release` or an iteration."""
    path = Path(path)
    if (path / ".metadata").is_file():
        return path
    tracker = path / TRACKER
    if not tracker.is_file():
        raise CheckpointError(f"{path}: neither a checkpoint (.metadata) nor a save root ({TRACKER})")
    it = tracker.read_text().strip()
    return path / (RELEASE if it == RELEASE else f"iter_{int(it):07d}")


def load_model_weights(model, path) -> None:
    """Fill `model` (an unwrapped GPTModel, any TP/PP/EP layout) from a torch_dist checkpoint."""
    from megatron.core import dist_checkpointing

    sharded = model.sharded_state_dict()
    loaded = dist_checkpointing.load(sharded, str(checkpoint_dir(path)))  # also holds common.pt's entries
    model.load_state_dict({key: loaded[key] for key in sharded})
