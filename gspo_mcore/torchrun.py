"""Deprecated: `python -m gspo_mcore.torchrun` is `python -m gspo_mcore.run.torchrun`."""

from gspo_mcore.common.deprecation import moved
from gspo_mcore.run.torchrun import main

moved("gspo_mcore.torchrun", "python -m gspo_mcore.run.torchrun")

if __name__ == "__main__":
    main()
