"""Turn code problems into a prompt dataset for `reward.name: code` (JSONL: prompt, answer, and the
record's other fields but its tests): LiveCodeBench `code_generation_lite`, TACO / APPS,
CodeContests or PrimeIntellect rows, as downloaded (.jsonl or .parquet). The prompt is
LiveCodeBench's format (the question, then the starter code to complete for functional
problems, or the stdin / stdout instruction); `answer` holds the tests as
gspo_mcore.rewards.code reads them. A row whose tests cannot be read stops the run with one line
naming the row and the field; nothing is written.

    python -m gspo_mcore.data.prepare_code --input test6.jsonl --output lcb_v6.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from gspo_mcore.common.records import read_records
from gspo_mcore.data.dataset import prepare_command
from gspo_mcore.common.errors import InputError, run_cli
from gspo_mcore.common.files import atomic_output
from gspo_mcore.rewards.code import FORMATS, answer_from_problem, problem_from_record

QUESTION_FIELDS = ("question_content", "question", "description", "problem", "prompt")
TEST_FIELDS = {key for key, _ in FORMATS} | {"private_tests", "generated_tests", "answer", "checker", "tolerance"}
SYSTEM = ("You are an expert Python programmer. You will be given a question (problem specification) and will "
          "generate a correct Python program that matches the specification and passes all tests.")
FUNCTIONAL = ("### Format: You will use the following starter code to write the solution to the problem and "
              "enclose your code within delimiters.\n```python\n{starter}\n```\n\n")
STDIN = ("### Format: Read the inputs from stdin solve the problem and write the answer to stdout (do not directly "
         "test on the sample inputs). Enclose your code within delimiters as follows. Ensure that when the python "
         "program runs, it reads the inputs, runs the algorithm and writes output to STDOUT.\n"
         "```python\n# YOUR CODE HERE\n```\n\n")


def prompt_text(record: dict, where: str) -> str:
    question = next((record[k] for k in QUESTION_FIELDS if isinstance(record.get(k), str) and record[k].strip()), None)
    if question is None:
        raise InputError(f"{where}: no question: none of the fields {', '.join(QUESTION_FIELDS)}")
    starter = record.get("starter_code") or ""
    fmt = FUNCTIONAL.format(starter=starter.rstrip()) if starter.strip() else STDIN
    return f"### Question:\n{question.strip()}\n\n{fmt}### Answer: (use the provided format with backticks)\n\n"


def prepare(input_path, output_path) -> int:
    rows = []
    for where, record in read_records(Path(input_path)):  # every row checked before anything is written
        problem = problem_from_record(record, where)
        row = {"messages": [{"role": "system", "content": SYSTEM},
                            {"role": "user", "content": prompt_text(record, where)}],
               "answer": answer_from_problem(problem)}
        row.update({k: v for k, v in record.items() if k not in TEST_FIELDS | set(QUESTION_FIELDS) | {"messages"}})
        rows.append(json.dumps(row, default=str))
    with atomic_output(output_path) as tmp:
        with open(tmp, "w") as out:
            out.writelines(line + "\n" for line in rows)
    return len(rows)


def main() -> int:
    return prepare_command(prepare, __doc__.splitlines()[0], ".jsonl or .parquet of code problems")


if __name__ == "__main__":
    sys.exit(run_cli(main))
