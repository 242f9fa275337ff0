"""What a section function sees, in the parent and in a child: the device, the check's folders,
and in the parent where the lines go and how a child process starts; and the body of a child
(`run_in_child`: gpucheck.children starts the processes, importing nothing of the check's)."""

from __future__ import annotations

import functools
import importlib
import json
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from gpucheck.lines import Lines, error_figures, part_line


@dataclass
class Check:
    device: str  # "cuda" | "cpu"
    work: Path  # the synthetic checkpoint, section 4's save, the children's result files
    wheels: Path  # launch/wheelhouse.sh's folder (a child puts it on its path again)
    children: str = "spawn"  # how a child process starts: gpucheck.children.MODES
    child_timeout_s: float = 900.0
    lines: Lines | None = None  # the parent's; None in a child
    wheel_paths: int = 0  # how many paths the wheel folder put on sys.path

    @functools.cached_property
    def shape(self):
        from gpucheck.shape import Shape

        return Shape(self.device)

    @property
    def out_dir(self) -> Path | None:
        return self.lines.out_dir if self.lines is not None else None

    def common(self) -> dict:
        """What a child needs to rebuild this (strings: it goes on a command line)."""
        return {"device": self.device, "work": str(self.work), "wheels": str(self.wheels), "children": self.children}

    def child(self, target: str, **kwargs) -> dict:
        """`target` ("module:function", called as function(check, **kwargs)) in a process of its
        own: its figures (gpucheck.children)."""
        from gpucheck.children import run_child

        return run_child(self, target, kwargs, run_in_child)

    def part(self, number: int, part: str, figures: dict) -> dict:
        """One part of section `number` as its own line, out at once; the line."""
        line = part_line(number, part, figures)
        return self.lines.emit(line) if self.lines is not None else line


def run_in_child(target: str, kwargs: dict, common: dict, result: Path) -> None:
    """In the child: `target` ("module:function") called as function(check, **kwargs); its figures,
    or what it raised as a FAIL's figures, written to `result` (temporary name, then renamed)."""
    check = Check(device=common["device"], work=Path(common["work"]), wheels=Path(common["wheels"]),
                  children=common["children"])
    module, _, name = target.partition(":")
    began = time.perf_counter()
    try:
        figures = getattr(importlib.import_module(module), name)(check, **kwargs)
    except Exception as err:  # noqa: BLE001 (the child's verdict; the parent prints it)
        traceback.print_exc()
        figures = error_figures(err)
    figures.setdefault("child_s", round(time.perf_counter() - began, 2))
    partial = result.with_suffix(".part")
    partial.write_text(json.dumps(figures, default=str))
    partial.rename(result)
