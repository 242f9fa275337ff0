"""Turn MATH-lighteval-style data (`problem`, `solution` with a final \\boxed{}) into a
prompt dataset (JSONL: prompt, answer, plus level/type when present).

    python -m gspo_mcore.data.prepare_math --input train.parquet --output math_train.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gspo_mcore.data.dataset import _records
from gspo_mcore.errors import InputError, run_cli
from gspo_mcore.files import atomic_output
from gspo_mcore.rewards.answers import last_boxed

INSTRUCTION = "Solve the problem step by step. Put the final answer in \\boxed{}."


def prepare(input_path, output_path) -> int:
    count = 0
    with atomic_output(output_path) as tmp:
        with open(tmp, "w") as out:
            for where, record in _records(Path(input_path)):
                for key in ("problem", "solution"):
                    if key not in record:
                        raise InputError(f"{where}: missing field '{key}'")
                answer = last_boxed(record["solution"])
                if answer is None:
                    raise InputError(f"{where}: solution has no complete \\boxed{{}} answer")
                row = {"prompt": f"{record['problem']}\n\n{INSTRUCTION}", "answer": answer}
                row.update({k: record[k] for k in ("level", "type") if k in record})
                out.write(json.dumps(row) + "\n")
                count += 1
    return count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help=".jsonl or .parquet with problem/solution")
    parser.add_argument("--output", required=True, help=".jsonl to write")
    args = parser.parse_args()
    if not Path(args.input).is_file():
        raise InputError(f"{args.input}: input file not found")
    print(f"wrote {prepare(args.input, args.output)} prompts to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
