"""Deprecated: `python -m gspo_mcore.plan` is `python -m gspo_mcore.planner.cli`."""

import sys

from gspo_mcore.common.deprecation import moved
from gspo_mcore.common.errors import run_cli
from gspo_mcore.planner.cli import *  # noqa: F401,F403 (its names, for code that imported gspo_mcore.plan)
from gspo_mcore.planner.cli import main

moved("gspo_mcore.plan", "python -m gspo_mcore.planner.cli")

if __name__ == "__main__":
    sys.exit(run_cli(main))
