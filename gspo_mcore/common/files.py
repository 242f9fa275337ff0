"""Outputs that appear whole or not at all.

A reader (the trainer resuming, SGLang loading weights, a person opening a plot) must never
see a half-written file or directory: it is written under a temporary sibling name and
renamed into place only when complete. A crash or kill mid-write leaves only the temporary
(`<name>.tmp-<pid>`), which the next writer from the same process id replaces.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterator

# In a run's checkpoints/: the file naming its newest complete checkpoint (the checkpointer writes it,
# the output-directory check reads it without importing Megatron).
LATEST = "latest"


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_output(path, *, directory: bool = False) -> Iterator[Path]:
    """Yield `<path>.tmp-<pid>` (an empty directory when `directory`) to write into; when the
    block completes it replaces `path` (an existing directory is removed first: a directory
    cannot be renamed over a non-empty one), and when it raises the temporary is removed."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    _remove(tmp)  # left by an earlier process with the same id
    tmp.parent.mkdir(parents=True, exist_ok=True)
    if directory:
        tmp.mkdir()
    try:
        yield tmp
        if directory and path.exists():
            _remove(path)
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise


@contextlib.contextmanager
def atomic_output_all_ranks(path) -> Iterator[Path]:
    """`atomic_output(path, directory=True)` for a directory every rank writes into
    (collective): rank 0 creates the temporary and, once every rank has left the block,
    renames it into place."""
    import torch.distributed as dist  # here: reward workers import this module, and torch costs them 1 s

    with contextlib.ExitStack() as stack:
        tmp = [stack.enter_context(atomic_output(path, directory=True)) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(tmp, src=0)
        yield tmp[0]
        dist.barrier()
    dist.barrier()
