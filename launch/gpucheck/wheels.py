"""The wheel folder `launch/wheelhouse.sh DIR` fills, put on sys.path without pip (a bare GPU
machine's Python may be externally managed, and pip would fetch another torch). Offline."""

from __future__ import annotations

import os
import sys
import zipfile
from pathlib import Path


def wheel_paths(folder: Path, cache: Path) -> list[Path]:
    """What to put on sys.path for the wheels in `folder`: a wheel of pure Python is imported from
    the zip itself (zipimport); one with compiled parts (WHEEL: Root-Is-Purelib: false, e.g.
    megatron-core's dataset helpers) is unpacked once into `cache` (a shared library cannot be
    loaded from a zip). The folder itself too: it holds vLLM's packed_tensor.py."""
    paths = []
    for wheel in sorted(folder.glob("*.whl")):
        with zipfile.ZipFile(wheel) as archive:
            meta = next(n for n in archive.namelist() if n.endswith(".dist-info/WHEEL"))
            pure = "root-is-purelib: true" in archive.read(meta).decode().lower()
            compiled = any(n.endswith((".so", ".pyd")) for n in archive.namelist())
            if pure and not compiled:
                paths.append(wheel)
                continue
            target = cache / wheel.stem
            if not (target / ".complete").exists():
                archive.extractall(target)
                (target / ".complete").touch()
            paths.append(target)
    return paths + [folder]


def use_wheels(folder: Path) -> list[str]:
    """The wheel folder ahead of everything installed (its megatron-core is the one pinned); the
    paths put on sys.path ([] when `folder` is not a folder). A second call adds nothing."""
    if not folder.is_dir():
        return []
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "gspo_gpu_check"
    paths = [str(p) for p in wheel_paths(folder, cache)]
    sys.path[:0] = [p for p in paths if p not in sys.path]
    return paths
