"""Turn code problems into a prompt dataset for the code rewards (`reward.name: code`, `code_all`,
`gspo_mcore.rewards.code:code_group_reward`).

Reads, as downloaded (.jsonl or .parquet): LiveCodeBench `code_generation_lite`, TACO / APPS,
CodeContests, PrimeIntellect rows, or verl's (a chat `prompt` and prime_code's tests in
`reward_model.ground_truth`). Writes one JSON line per problem:

  messages  [system, user]: LiveCodeBench's prompt (the question, then the starter code to
            complete for functional problems, else the stdin / stdout instruction); a verl row's
            own chat `prompt` as it is
  answer    what the reward needs, as gspo_mcore.rewards.code reads it: {"kind", "func_name",
            "tolerance", "checker", "time_limit_s", "tests": [[input, output], ...]}
  ...       the row's other fields (ids, contest_date, difficulty, platform, ...), but not its
            tests, its question or its solutions (`solutions`, `incorrect_solutions`,
            `gold_standard_solution`: `python -m gspo_mcore.rewards.code --references` reads them
            from the downloaded rows)

--since / --until YYYY-MM-DD keep the problems whose `contest_date` (LiveCodeBench's release
date) is in the window, both ends included (each day at 00:00), as LiveCodeBench's own
--start_date / --end_date:
evaluate on problems released after the model's training data (the contamination guard).
Every row kept is read before anything is written; a row whose tests (or date) cannot be read
stops the command with one line naming the row and the field, and nothing is written.

    python -m gspo_mcore.data.prepare_code --input test6.jsonl --output lcb_v6.jsonl
    python -m gspo_mcore.data.prepare_code --input test6.jsonl --output lcb_2502_2505.jsonl \\
        --since 2025-02-01 --until 2025-05-01
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import date, datetime, timezone
from pathlib import Path

from gspo_mcore.common.records import read_records
from gspo_mcore.data.dataset import is_chat, prepare_command
from gspo_mcore.common.errors import InputError, run_cli
from gspo_mcore.common.files import atomic_output
from gspo_mcore.rewards.code import FORMATS, answer_from_problem, problem_from_record

QUESTION_FIELDS = ("question_content", "question", "description", "problem", "prompt")
TEST_FIELDS = {key for key, _ in FORMATS} | {"private_tests", "generated_tests", "answer", "checker", "tolerance"}
# Not for the prompt rows: the model must not see them, and the reward does not read them (a
# CodeContests row carries hundreds of them; --references reads them from the downloaded rows).
SOLUTION_FIELDS = {"solutions", "incorrect_solutions", "gold_standard_solution"}
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


def messages_for(record: dict, where: str) -> list[dict]:
    if is_chat(record.get("prompt")) and record["prompt"]:  # verl's row: its chat is the prompt
        return record["prompt"]
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt_text(record, where)}]


def day(text: str) -> datetime:
    """A --since / --until argument: YYYY-MM-DD, midnight (LiveCodeBench's own parse)."""
    try:
        return datetime.strptime(text, "%Y-%m-%d")
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a date YYYY-MM-DD") from None


def contest_date(record: dict, where: str) -> datetime:
    """The row's `contest_date` (an ISO date or date-time string, or Parquet's timestamp), naive UTC."""
    value = record.get("contest_date")
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
        except ValueError:
            raise InputError(f"{where}: field 'contest_date': not an ISO date ({value[:40]!r})") from None
    elif isinstance(value, date) and not isinstance(value, datetime):
        value = datetime.combine(value, datetime.min.time())
    if not isinstance(value, datetime):
        raise InputError(f"{where}: field 'contest_date': missing (--since / --until select problems by it)")
    return value.astimezone(timezone.utc).replace(tzinfo=None) if value.tzinfo else value


def prepare(input_path, output_path, since: datetime | None = None, until: datetime | None = None) -> int:
    """The prompt rows of `input_path`'s problems (those in the window [since, until] of their
    contest_date, when given) to `output_path`; how many it wrote."""
    rows, read = [], 0
    for where, record in read_records(Path(input_path)):  # every row kept checked before anything is written
        read += 1
        if since is not None or until is not None:
            released = contest_date(record if isinstance(record, dict) else {}, where)
            if (since is not None and released < since) or (until is not None and released > until):
                continue
        problem = problem_from_record(record, where)
        row = {"messages": messages_for(record, where), "answer": answer_from_problem(problem)}
        row.update({k: v for k, v in record.items()
                    if k not in TEST_FIELDS | SOLUTION_FIELDS | set(QUESTION_FIELDS) | {"messages"}})
        rows.append(json.dumps(row, default=str))
    if not rows:
        window = f" with a contest_date in [{since or '-'}, {until or '-'}]" if since or until else ""
        raise InputError(f"{input_path}: no problems{window} ({read} rows read)")
    with atomic_output(output_path) as tmp:
        with open(tmp, "w") as out:
            out.writelines(line + "\n" for line in rows)
    return len(rows)


def main(argv: list[str] | None = None) -> int:
    window = "keep problems whose contest_date is at or {} this day's 00:00 (LiveCodeBench's --{}_date)"
    return prepare_command(prepare, __doc__, ".jsonl or .parquet of code problems",
                           prog="python -m gspo_mcore.data.prepare_code",
                           options=[("--since", {"type": day, "metavar": "YYYY-MM-DD",
                                                 "help": window.format("after", "start")}),
                                    ("--until", {"type": day, "metavar": "YYYY-MM-DD",
                                                 "help": window.format("before", "end")})], argv=argv)


if __name__ == "__main__":
    sys.exit(run_cli(main))
