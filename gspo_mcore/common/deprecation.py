"""Old import paths kept for a release, in one table: `MOVED` maps each module path the README, the
docs or a config ever showed to where it lives now. `install()` (run by `gspo_mcore/__init__.py`)
puts a finder on `sys.meta_path` that answers those names, so no shim files are needed:

- `import gspo_mcore.loss` / `from gspo_mcore.loss import policy_loss` gives a module that forwards
  every attribute to `gspo_mcore.gspo.loss` (the same objects: a monkeypatch of either is seen by both);
- `python -m gspo_mcore.toy_task ...` runs `gspo_mcore.tasks.toy` as `__main__` (runpy asks the
  finder for the code), so an old command does what it did, not nothing;
- an old package (`gspo_mcore.models`) answers its old submodules by the same table.

Each warns once, at the user's import line, with the new path and the release that drops it.

A user's reward, rollout function, tool or loss is imported by `gspo_mcore.common.plugins.by_name`, not
by `__main__`, where Python's default filters hide a DeprecationWarning: `MovedWarning` is shown
by default so the person running `gspo-train` sees it; it is still a DeprecationWarning to filters
and to `pytest.warns`."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings

# The release that removes every path below (CHANGELOG.md says the same).
REMOVED_AFTER = "2027-03-01"


class MovedWarning(DeprecationWarning):
    """An import path that moved: it works until REMOVED_AFTER."""


# old module path -> (its module now, what to write instead). A prefix entry (a package) also maps
# its submodules: gspo_mcore.models.qwen3_moe.tiny -> gspo_mcore.megatron.qwen3_moe.tiny.
MOVED: dict[str, tuple[str, str]] = {
    # the flat modules before the package layout (README, docs/03, docs/07, docs/11, configs)
    **{f"gspo_mcore.{old}_task": (f"gspo_mcore.tasks.{old}", f"gspo_mcore.tasks.{old}")
       for old in ("toy", "long", "agent", "code")},
    "gspo_mcore.plan": ("gspo_mcore.planner.cli", "python -m gspo_mcore.planner.cli"),
    "gspo_mcore.plot": ("gspo_mcore.run.plot", "python -m gspo_mcore.run.plot"),
    "gspo_mcore.parity": ("gspo_mcore.megatron.parity", "python -m gspo_mcore.megatron.parity"),
    "gspo_mcore.torchrun": ("gspo_mcore.run.torchrun", "python -m gspo_mcore.run.torchrun"),
    "gspo_mcore.evaluate": ("gspo_mcore.evaluation.cli", "gspo-eval (python -m gspo_mcore.evaluation.cli)"),
    "gspo_mcore.config_reference": ("gspo_mcore.config.reference", "python -m gspo_mcore.config.reference"),
    "gspo_mcore.loss": ("gspo_mcore.gspo.loss", "from gspo_mcore.api import ... (extension code), "
                                                "else gspo_mcore.gspo.loss"),
    "gspo_mcore.advantages": ("gspo_mcore.gspo.advantages", "gspo_mcore.gspo.advantages"),
    "gspo_mcore.logprobs": ("gspo_mcore.gspo.logprobs", "gspo_mcore.gspo.logprobs"),
    "gspo_mcore.learner": ("gspo_mcore.megatron.learner", "gspo_mcore.megatron.learner"),
    "gspo_mcore.optimizer": ("gspo_mcore.megatron.optimizer", "gspo_mcore.megatron.optimizer"),
    "gspo_mcore.checkpointing": ("gspo_mcore.megatron.checkpointing", "gspo_mcore.megatron.checkpointing"),
    "gspo_mcore.megatron_loss": ("gspo_mcore.megatron.pipeline_loss", "gspo_mcore.megatron.pipeline_loss"),
    "gspo_mcore.models": ("gspo_mcore.megatron", "gspo_mcore.megatron.qwen3_moe"),
    "gspo_mcore.metric_schema": ("gspo_mcore.metrics.schema", "gspo_mcore.metrics.schema"),
    "gspo_mcore.samples": ("gspo_mcore.batch.rollout", "from gspo_mcore.api import Rollout"),
    "gspo_mcore.trajectory": ("gspo_mcore.batch.trajectory", "from gspo_mcore.api import Trajectory"),
    "gspo_mcore.rollout.trajectory": ("gspo_mcore.batch.trajectory", "from gspo_mcore.api import Trajectory"),
    "gspo_mcore.rollout.serve": ("gspo_mcore.engines.serve", "python -m gspo_mcore.engines.serve"),
    "gspo_mcore.rollout.server": ("gspo_mcore.engines.serve", "python -m gspo_mcore.engines.serve"),
    "gspo_mcore.preemption": ("gspo_mcore.run.preemption", "gspo_mcore.run.preemption"),
    "gspo_mcore.seeds": ("gspo_mcore.common.seeds", "gspo_mcore.common.seeds"),
    "gspo_mcore.netaddr": ("gspo_mcore.common.netaddr", "gspo_mcore.common.netaddr"),
    "gspo_mcore.processes": ("gspo_mcore.common.processes", "gspo_mcore.common.processes"),
}


def new_home(old: str) -> tuple[str, str] | None:
    """(the module `old` is now, what to write instead), or None if `old` never moved."""
    for prefix in sorted(MOVED, key=len, reverse=True):
        if old == prefix:
            return MOVED[prefix]
        if old.startswith(prefix + "."):  # a submodule of a moved package: its own new path
            home = MOVED[prefix][0] + old[len(prefix):]
            return home, home
    return None


def moved(old: str, new: str, stacklevel: int = 3) -> None:
    """Warn that `old` (a module path) moved: `new` says what to write instead."""
    # The default stacklevel: the line that imported the caller (warnings skip importlib's frames).
    warnings.warn(f"{old} is deprecated and goes in the release after {REMOVED_AFTER}: {new}", MovedWarning,
                  stacklevel=stacklevel)


class _Forwarding(types.ModuleType):
    """An old path's module: every attribute is the new module's (read at each access)."""

    def __getattr__(self, name: str):
        return getattr(object.__getattribute__(self, "__target__"), name)

    def __dir__(self):
        return dir(object.__getattribute__(self, "__target__"))


class _MovedLoader(importlib.abc.Loader):
    def __init__(self, old: str, home: str, instead: str):
        self.old, self.home, self.instead = old, home, instead

    def create_module(self, spec):
        module = _Forwarding(spec.name)
        module.__target__ = importlib.import_module(self.home)
        # Set here, not forwarded: importlib keeps a module's own, and the new package's __path__
        # would load its files a second time under the old names (two copies of every class).
        module.__loader__, module.__file__ = self, spec.origin
        if spec.submodule_search_locations is not None:
            module.__path__, module.__package__ = [], spec.name
        else:
            module.__package__ = spec.parent
        return module

    def exec_module(self, module) -> None:
        moved(self.old, self.instead, stacklevel=3)  # importlib's frames are skipped: the importing line

    # runpy (`python -m OLD`) runs the code of the new module as __main__.
    def get_code(self, fullname: str):
        moved(f"python -m {self.old}", self.instead, stacklevel=3)
        spec = importlib.util.find_spec(self.home)
        return spec.loader.get_code(self.home)

    def is_package(self, fullname: str) -> bool:
        return False


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path=None, target=None):
        if not fullname.startswith("gspo_mcore.") or not (found := new_home(fullname)):
            return None
        home, instead = found
        target_spec = importlib.util.find_spec(home)
        if target_spec is None:
            return None
        spec = importlib.machinery.ModuleSpec(fullname, _MovedLoader(fullname, home, instead),
                                              origin=target_spec.origin,
                                              is_package=target_spec.submodule_search_locations is not None)
        if spec.submodule_search_locations is not None:
            spec.submodule_search_locations = []  # its submodules come from this finder too
        return spec


def install() -> None:
    """Idempotent: the finder answers the old paths, after every real module (a real file wins)."""
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedFinder())


# In front of the defaults' `ignore::DeprecationWarning`, unless the user chose filters (-W,
# PYTHONWARNINGS); one added after this import (pytest's filterwarnings) still takes precedence.
if not sys.warnoptions:
    warnings.filterwarnings("default", category=MovedWarning)
