"""A run's output directory: what marks one, what a new run may write into, what --overwrite removes."""

from __future__ import annotations

import shutil
from pathlib import Path

from gspo_mcore.common.errors import InputError
from gspo_mcore.common.files import LATEST

# What a run writes into OUTPUT_DIR (--overwrite removes them); the first two mark a run.
RUN_MARKERS = ("checkpoints", "metrics.jsonl")
RUN_FILES = (*RUN_MARKERS, "eval.jsonl", "samples", "tensorboard", "hf", "logs", "plots", "weights_sync", "wandb",
             "wandb_run_id")


def default_output_dir(config_path: str) -> Path:
    return Path("runs") / Path(config_path).stem


def holds_run(output_dir: Path) -> bool:
    return any((Path(output_dir) / name).exists() for name in RUN_MARKERS)


def resumable(output_dir: Path) -> bool:
    return (Path(output_dir) / "checkpoints" / LATEST).is_file()


def check_output_dir(output_dir: Path, resume: bool, overwrite: bool) -> None:
    """A new run never writes into another run's directory unless told to."""
    if resume and overwrite:
        raise InputError("--resume and --overwrite: choose one")
    if not resume and not overwrite and holds_run(output_dir):
        if resumable(output_dir):
            raise InputError(f"{output_dir}: holds a run already: --resume continues it, --overwrite replaces it")
        raise InputError(f"{output_dir}: holds a run that saved no checkpoint (nothing to resume): --overwrite "
                         "replaces it, or choose another --output-dir")


def clear_run(output_dir: Path) -> None:
    for name in RUN_FILES:
        path = Path(output_dir) / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
