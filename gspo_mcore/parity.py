"""Deprecated: `python -m gspo_mcore.parity` is `python -m gspo_mcore.megatron.parity`."""

import sys

from gspo_mcore.common.deprecation import moved
from gspo_mcore.common.errors import run_cli
from gspo_mcore.megatron.parity import *  # noqa: F401,F403 (its names, for code that imported gspo_mcore.parity)
from gspo_mcore.megatron.parity import main

moved("gspo_mcore.parity", "python -m gspo_mcore.megatron.parity")

if __name__ == "__main__":
    sys.exit(run_cli(main))
