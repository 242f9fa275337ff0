"""A tool with the agent task's signature (gspo_mcore.tasks.agent.lookup) that fails on every
call: the run must stop, not train on its error messages (tests/test_trajectories.py)."""


def lookup(table: str, key: str) -> str:
    """Look a key up in a table.

    Args:
        table: The table's name.
        key: The key.
    """
    raise KeyError(f"no table {table!r} (the tables were never loaded)")
