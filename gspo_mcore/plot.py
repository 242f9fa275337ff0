"""Deprecated: `python -m gspo_mcore.plot` is `python -m gspo_mcore.run.plot`."""

import sys

from gspo_mcore.common.deprecation import moved
from gspo_mcore.common.errors import run_cli
from gspo_mcore.run.plot import *  # noqa: F401,F403 (its names, for code that imported gspo_mcore.plot)
from gspo_mcore.run.plot import main

moved("gspo_mcore.plot", "python -m gspo_mcore.run.plot")

if __name__ == "__main__":
    sys.exit(run_cli(main))
