"""`reward.name: code`: the public formats read (and refused with one line), scoring rules, the
scoring command and prepare_code, every program run in the real sandbox."""

from __future__ import annotations

import base64
import json
import os
import pickle
import subprocess
import sys
import zlib

import pytest

from gspo_mcore.data.prepare_code import prepare
from gspo_mcore.errors import InputError
from gspo_mcore.rewards import load_reward_fn
from gspo_mcore.rewards.code import (answer_from_problem, code_reward, last_code_block, problem_from_record, score,
                                     take_stats, training_tests)
from gspo_mcore.sandbox import Problem, Test

ADD = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
WRONG = "```python\nprint(0)\n```"


def lcb_encoded(text: str) -> str:
    """LiveCodeBench's release encoding of private_test_cases."""
    return base64.b64encode(zlib.compress(pickle.dumps(text))).decode()


def lcb_row(private: str | None = None, functional: bool = False) -> dict:
    if functional:
        cases = [{"input": "[3, 1, 2]\n1", "output": "[1, 2, 3, 1]", "testtype": "functional"}]
        return {"question_content": "Sort then append k.", "starter_code": "class Solution:\n    def go(self, a, k):\n",
                "public_test_cases": json.dumps(cases), "private_test_cases": private or "[]",
                "metadata": json.dumps({"func_name": "go"})}
    cases = [{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}]
    return {"question_content": "Add two numbers.", "starter_code": "", "public_test_cases": json.dumps(cases),
            "private_test_cases": private or "[]", "metadata": "{}"}


# ---- formats

def test_livecodebench_rows_with_released_private_tests():
    private = lcb_encoded(json.dumps([{"input": "5 7\n", "output": "12\n", "testtype": "stdin"}]))
    problem = problem_from_record(lcb_row(private), "lcb.jsonl:1")
    assert problem == Problem("stdin", (Test("1 2\n", "3\n"), Test("5 7\n", "12\n")))
    functional = problem_from_record(lcb_row(functional=True), "lcb.jsonl:2")
    assert functional.kind == "functional" and functional.func_name == "go"
    assert json.loads(functional.tests[0].input) == [[3, 1, 2], 1]
    program = "```python\nclass Solution:\n    def go(self, a: List[int], k: int) -> List[int]:\n" \
              "        return sorted(a) + [k]\n```"
    assert score(program, functional).passed


class Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/gspo-pwned",))


@pytest.mark.parametrize("payload, said", [
    (pickle.dumps(Evil()), "refused global"),
    (pickle.dumps([{"input": "1", "output": "1"}]), "holds a list, not a str"),
])
def test_a_private_pickle_holding_anything_but_a_str_is_refused_unbuilt(payload, said):
    encoded = base64.b64encode(zlib.compress(payload)).decode()
    with pytest.raises(InputError) as refused:
        problem_from_record(lcb_row(encoded), "lcb.jsonl:7")
    message = str(refused.value)
    assert message.startswith("lcb.jsonl:7: field 'private_test_cases'") and said in message
    assert "\n" not in message and not os.path.exists("/tmp/gspo-pwned")


def test_taco_codecontests_and_primeintellect_rows():
    taco = problem_from_record({"input_output": json.dumps({"inputs": ["1 2\n"], "outputs": ["3\n"]})}, "t:1")
    assert taco == Problem("stdin", (Test("1 2\n", "3\n"),))
    taco_call = problem_from_record({"input_output": {"inputs": [[2, 3]], "outputs": [[5]], "fn_name": "add"}}, "t:2")
    assert score("```python\ndef add(a, b):\n    return a + b\n```", taco_call).passed  # APPS: [5] means 5
    contests = problem_from_record({"public_tests": {"input": ["1 2\n"], "output": ["3\n"]},
                                    "private_tests": {"input": ["2 2\n"], "output": ["4\n"]},
                                    "generated_tests": {"input": [], "output": []}}, "c:1")
    assert [t.output for t in contests.tests] == ["3\n", "4\n"]
    info = {"language": "python", "test_cases": [{"type": "stdin_stdout", "input": "1 2\n", "output": "3\n"}]}
    assert problem_from_record({"verification_info": json.dumps(info)}, "p:1") == taco
    for problem in (taco, contests):
        assert score(ADD, problem).passed and not score(WRONG, problem).passed


@pytest.mark.parametrize("record, said", [
    ({"prompt": "x"}, "p:3: no tests"),
    ({"input_output": "{not json"}, "p:3: field 'input_output': not JSON"),
    ({"input_output": {"inputs": ["1"], "outputs": []}}, "p:3: field 'input_output'"),
    ({"public_tests": {"input": ["1"], "output": []}}, "p:3: field 'public_tests'"),
    ({"verification_info": {"test_cases": []}}, "p:3: field 'verification_info': no test_cases"),
    ({"public_test_cases": json.dumps([{"input": "[1]", "output": "1", "testtype": "functional"}]),
      "metadata": "{}"}, "p:3: field 'metadata'"),
])
def test_a_row_whose_tests_cannot_be_read_is_named(record, said):
    with pytest.raises(InputError) as refused:
        problem_from_record(record, "p:3")
    assert str(refused.value).startswith(said) and "\n" not in str(refused.value)


# ---- scoring

def test_the_last_fenced_block_is_the_program():
    assert last_code_block("think\n```python\nprint(1)\n```\nthen\n```\nprint(2)\n```") == "print(2)\n"
    assert last_code_block("no code here") is None


def test_training_subset_all_tests_and_fraction(monkeypatch):
    from gspo_mcore.rewards import code

    monkeypatch.setattr(code, "HACK_CHECK_SHARE", 1.0)  # every response that passes its subset is checked
    tests = tuple(Test(f"{i} {i}\n", f"{2 * i}\n") for i in range(40))
    problem = Problem("stdin", tests)
    subset = training_tests(problem, 16)
    assert len(subset) == 16 and subset == training_tests(problem, 16)  # deterministic
    cheat = "```python\na, b = map(int, input().split())\nprint(a + b if (a, b) in %r else -1)\n```" % (
        [tuple(map(int, t.input.split())) for t in subset])
    take_stats()
    assert score(cheat, problem).reward == 1.0  # passes the training subset ...
    assert score(cheat, problem, every_test=True).reward == 0.0  # ... not every test
    assert score(cheat, problem, every_test=True, fraction=True).reward == pytest.approx(16 / 40)
    stats = take_stats()
    assert stats.responses == 3 and stats.tests_run == 16 + 1 + 40 + 40  # the hack check stops at its first failure
    assert stats.hack_checked == 1 and stats.hacks == 1
    assert score("no program", problem).no_program and take_stats().no_program == 1


def test_the_reward_is_registered_and_reads_prepare_codes_answer():
    answer = answer_from_problem(Problem("stdin", (Test("1 2\n", "3\n"), Test("5 7\n", "12\n"))))
    assert code_reward(ADD, answer) == 1.0 and code_reward(WRONG, answer) == 0.0
    assert load_reward_fn("code")(ADD, answer) == 1.0 and load_reward_fn("code")(WRONG, answer) == 0.0
    assert load_reward_fn("code_all")(ADD, answer) == 1.0


# ---- the commands

def test_prepare_code_and_the_scoring_command(tmp_path):
    raw = tmp_path / "lcb.jsonl"
    private = lcb_encoded(json.dumps([{"input": "5 7\n", "output": "12\n", "testtype": "stdin"}]))
    raw.write_text(json.dumps(lcb_row(private)) + "\n" + json.dumps(lcb_row(functional=True)) + "\n")
    prepared = tmp_path / "prompts.jsonl"
    assert prepare(raw, prepared) == 2
    rows = [json.loads(line) for line in prepared.read_text().splitlines()]
    assert "Read the inputs from stdin" in rows[0]["messages"][1]["content"]
    assert "def go(self, a, k)" in rows[1]["messages"][1]["content"]
    assert "private_test_cases" not in rows[0] and code_reward(ADD, rows[0]["answer"]) == 1.0

    scored = tmp_path / "scored.jsonl"
    inputs = tmp_path / "responses.jsonl"
    inputs.write_text(json.dumps({**lcb_row(private), "response": ADD}) + "\n"
                      + json.dumps({**lcb_row(private), "response": WRONG}) + "\n")
    done = subprocess.run([sys.executable, "-m", "gspo_mcore.rewards.code", "--input", str(inputs), "--output",
                           str(scored)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in scored.read_text().splitlines()]
    assert [(x["reward"], x["passed"], x["verdicts"]) for x in lines] == [
        (1.0, True, ["passed", "passed"]), (0.0, False, ["wrong", "wrong"])]

    taco = tmp_path / "taco.jsonl"  # --references: a dataset whose own solutions fail needs a checker
    taco.write_text(json.dumps({"input_output": {"inputs": ["1 2\n"], "outputs": ["3\n"]},
                                "solutions": json.dumps(["print(3)", "print(4)"])}) + "\n")
    done = subprocess.run([sys.executable, "-m", "gspo_mcore.rewards.code", "--input", str(taco), "--references"],
                          capture_output=True, text=True, timeout=120)
    assert [json.loads(line)["passed"] for line in done.stdout.splitlines()] == [True, False]
    assert "1/2 passed" in done.stderr

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"input_output": "{broken"}) + "\n")
    done = subprocess.run([sys.executable, "-m", "gspo_mcore.rewards.code", "--input", str(bad), "--output",
                           str(tmp_path / "out.jsonl")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and f"{bad}:1: field 'input_output'" in done.stderr
    assert not (tmp_path / "out.jsonl").exists()


def test_the_cpu_code_tasks_answers_are_programs_judged_in_the_sandbox(tmp_path):
    from gspo_mcore.code_task import OPERATIONS, expressions, make_prompts, program_rewards, vocabulary

    assert len(vocabulary()) == 256
    make_prompts(tmp_path / "p.jsonl", 8, seed=3)
    record = json.loads((tmp_path / "p.jsonl").read_text().splitlines()[0])
    operation = record["prompt"].split()[1]
    tests = json.loads(record["answer"])["tests"]
    inputs = [tuple(map(int, i.split())) for i, _ in tests]
    other = next(op for op in OPERATIONS  # one that prints another number on some test
                 if any(OPERATIONS[op](a, b) != OPERATIONS[operation](a, b) for a, b in inputs))
    responses = [f"{expressions(operation)[7]} 3 write", "write ( )", "", expressions(other)[0]]
    rewards = program_rewards(responses, [record["answer"]] * 4)
    assert rewards == [1.0, 0.0, 0.0, 0.0]  # the right op; not an expression; nothing; a wrong op


def test_a_checker_accepts_any_valid_answer_and_a_tolerance_any_close_number():
    record = {"input_output": {"inputs": ["12\n"], "outputs": ["2\n"]},  # any proper divisor of n is right
              "checker": "def check(input, output, expected):\n    n, d = int(input), int(output)\n"
                         "    return 1 < d < n and n % d == 0\n"}
    problem = problem_from_record(record, "t:1")
    assert problem_from_record({"answer": answer_from_problem(problem)}, "t:1") == problem  # prepare_code keeps it
    assert score("```python\nprint(3)\n```", problem).passed  # not the listed answer: the checker's call
    assert not score("```python\nprint(5)\n```", problem).passed
    assert not score("```python\nprint(3)\n```", problem_from_record({**record, "checker": None}, "t:1")).passed
    broken = problem_from_record({**record, "checker": "def check(i, o, e):\n    raise ValueError\n"}, "t:1")
    assert score("```python\nprint(3)\n```", broken).infrastructure_error  # never a pass, never a wrong answer
    close = problem_from_record({"input_output": {"inputs": [""], "outputs": ["0.333333\n"]}, "tolerance": 1e-4}, "t:2")
    assert score("```python\nprint(1/3)\n```", close).passed
    with pytest.raises(InputError, match="t:3: field 'checker'"):
        problem_from_record({**record, "checker": "print(1)"}, "t:3")
