"""`python -m gspo_mcore.rehearse` (and `gspo-rehearse`): the config's training step rehearsed on CPU
at its real shapes (gspo_mcore.rehearsal.cli)."""

import sys

from gspo_mcore.rehearsal.cli import main

if __name__ == "__main__":
    sys.exit(main())
