"""Deprecated: `python -m gspo_mcore.rollout.serve` is `python -m gspo_mcore.engines.serve`."""

import sys

from gspo_mcore.common.deprecation import moved
from gspo_mcore.engines.serve import main
from gspo_mcore.common.errors import run_cli

moved("python -m gspo_mcore.rollout.serve", "python -m gspo_mcore.engines.serve")

if __name__ == "__main__":
    sys.exit(run_cli(main))
