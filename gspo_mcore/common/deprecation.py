"""Old import paths kept for a release: a shim module calls `moved(old, new)` at import.

A user's reward, rollout function, tool or loss is imported by `gspo_mcore.common.plugins.by_name`, not
by `__main__`, where Python's default filters hide a DeprecationWarning: `MovedWarning` is shown
by default (once per importing line) so the person running `gspo-train` sees it; it is still a
DeprecationWarning to filters and to `pytest.warns`."""

from __future__ import annotations

import sys
import warnings


class MovedWarning(DeprecationWarning):
    """An import path that moved: it works for one more release."""


# In front of the defaults' `ignore::DeprecationWarning`, unless the user chose filters (-W,
# PYTHONWARNINGS); one added after this import (pytest's filterwarnings) still takes precedence.
if not sys.warnoptions:
    warnings.filterwarnings("default", category=MovedWarning)


def moved(old: str, new: str) -> None:
    """Warn that `old` (a module path) moved: `new` says what to import instead."""
    # stacklevel 3: the line that imported the shim (warnings.warn skips importlib's frames).
    warnings.warn(f"{old} is deprecated and goes in the next release: {new}", MovedWarning, stacklevel=3)
