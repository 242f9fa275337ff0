"""Deprecated: `python -m gspo_mcore.evaluate` is `gspo-eval` (`python -m gspo_mcore.evaluation.cli`)."""

from gspo_mcore.common.deprecation import moved
from gspo_mcore.evaluation.cli import cli

moved("gspo_mcore.evaluate", "gspo-eval (python -m gspo_mcore.evaluation.cli)")

if __name__ == "__main__":
    cli()
