"""Records on disk, JSONL or Parquet, each with where it came from (file and line, or row) for
the one-line errors: datasets, and the code grader's command line, read them."""

from __future__ import annotations

import json
from pathlib import Path

from gspo_mcore.common.errors import InputError


def read_records(path: Path):
    """(where, record) pairs; `where` names the file and line or row for error messages."""
    if path.suffix == ".jsonl":
        with open(path) as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield f"{path}:{number}", json.loads(line)
                    except json.JSONDecodeError as err:
                        raise InputError(f"{path}:{number}: not valid JSON ({err})") from None
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq  # heavy: Parquet datasets only

        for number, record in enumerate(pq.read_table(path).to_pylist()):
            yield f"{path} row {number}", record
    else:
        raise InputError(f"{path}: unsupported dataset format (expected .jsonl or .parquet)")


def require_file(path) -> Path:
    """`path` as a Path; InputError naming it if there is no such file."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: dataset file not found")
    return path
