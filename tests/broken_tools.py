"""A tool with the agent task's signature (gspo_mcore.tasks.agent.lookup) that fails on every
call: tests/test_agent_cpu.py's run must stop, not train on its error messages."""


def lookup(table: str, key: str) -> str:
    """Look a key up in a table.

    Args:
        table: The table's name.
        key: The key.
    """
    raise KeyError(f"no table {table!r} (the tables were never loaded)")
