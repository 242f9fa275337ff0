"""`python -m gspo_mcore.train` is `gspo-train` (gspo_mcore.run.cli); the trainer is gspo_mcore.run.trainer.

Only the command line is here: `-m` runs this file as `__main__`, and the run imports the trainer
by name, so a file holding both was executed twice (tests/test_trainer_loop.py).
"""

from gspo_mcore.run.cli import train_cli

if __name__ == "__main__":
    train_cli()
