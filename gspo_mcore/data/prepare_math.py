"""Turn math problems into a prompt dataset (JSONL: prompt, answer, and the record's other
fields): MATH-lighteval-style records (`problem`, `solution` with a final \\boxed{}) or
AIME-style ones (`problem`, `answer`; an `answer` is taken as is when both are there). The
field names are matched in any case, so the published files load as downloaded:
MATH-lighteval's train parquet (problem, level, solution, type) for training, MATH-500's
test.jsonl (problem, solution, answer, subject, level, unique_id) and AIME 2024's
(ID, Problem, Solution, Answer) for evaluation (eval.datasets).

    python -m gspo_mcore.data.prepare_math --input train.parquet --output math_train.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from gspo_mcore.common.records import read_records
from gspo_mcore.data.dataset import prepare_command
from gspo_mcore.common.errors import InputError, run_cli
from gspo_mcore.common.files import atomic_output
from gspo_mcore.rewards.answers import last_boxed

FIELDS = ("problem", "solution", "answer")
INSTRUCTION = "Solve the problem step by step. Put the final answer in \\boxed{}."


def _field(record, key: str, where: str):
    if not isinstance(record, dict):
        raise InputError(f"{where}: expected an object")
    if key not in record:
        raise InputError(f"{where}: missing field '{key}'")
    return record[key]


def _answer(record: dict, where: str) -> str:
    """The record's `answer`, else the last \\boxed{} of its `solution`."""
    if "answer" in record:
        return str(record["answer"]).strip()
    if "solution" not in record:
        raise InputError(f"{where}: missing field 'answer' (or 'solution' with a \\boxed{{}} answer)")
    answer = last_boxed(record["solution"])
    if answer is None:
        raise InputError(f"{where}: solution has no complete \\boxed{{}} answer")
    return answer


def prepare(input_path, output_path) -> int:
    count = 0
    with atomic_output(output_path) as tmp:
        with open(tmp, "w") as out:
            for where, record in read_records(Path(input_path)):
                if isinstance(record, dict):  # AIME 2024's Problem / Answer as problem / answer
                    record = {k.lower() if k.lower() in FIELDS else k: v for k, v in record.items()}
                row = {"prompt": f"{_field(record, 'problem', where)}\n\n{INSTRUCTION}", "answer": _answer(record, where)}
                row.update({k: v for k, v in record.items() if k not in ("problem", "solution", "answer", "prompt")})
                out.write(json.dumps(row, default=str) + "\n")
                count += 1
    return count


def main() -> int:
    return prepare_command(prepare, __doc__.splitlines()[0], ".jsonl or .parquet with problem and solution or answer")


if __name__ == "__main__":
    sys.exit(run_cli(main))
