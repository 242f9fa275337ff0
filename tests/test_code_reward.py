"""`reward.name: code`: the public formats read (and refused with one line), scoring rules, the
scoring command and prepare_code, every program run in the real sandbox."""

from __future__ import annotations

import base64
import json
import os
import pickle
import re
import subprocess
import sys
import zlib
from dataclasses import replace

import pytest

from gspo_mcore.data.prepare_code import prepare
from gspo_mcore.common.errors import InputError
from gspo_mcore.rewards import load_reward_fn
from gspo_mcore.rewards.code import (answer_from_problem, code_reward, last_program, problem_from_record, score,
                                     take_stats, training_tests)
from gspo_mcore.rewards.code_config import CodeRewardConfig
from gspo_mcore.sandbox import Limits, Problem, Test

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
    assert problem == Problem("stdin", (Test("1 2\n", "3\n"), Test("5 7\n", "12\n")), origin="livecodebench")
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
    assert taco == Problem("stdin", (Test("1 2\n", "3\n"),), origin="taco")
    taco_call = problem_from_record({"input_output": {"inputs": [[2, 3]], "outputs": [[5]], "fn_name": "add"}}, "t:2")
    assert score("```python\ndef add(a, b):\n    return a + b\n```", taco_call).passed  # APPS: [5] means 5
    contests = problem_from_record({"public_tests": {"input": ["1 2\n"], "output": ["3\n"]},
                                    "private_tests": {"input": ["2 2\n"], "output": ["4\n"]},
                                    "generated_tests": {"input": [], "output": []}}, "c:1")
    assert [t.output for t in contests.tests] == ["3\n", "4\n"]
    info = {"language": "python", "test_cases": [{"type": "stdin_stdout", "input": "1 2\n", "output": "3\n"}]}
    assert problem_from_record({"verification_info": json.dumps(info)}, "p:1") == replace(taco, origin="primeintellect")
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
    assert last_program("think\n```python\nprint(1)\n```\nthen\n```\nprint(2)\n```") == ("python", "print(2)\n")
    assert last_program("no code here") is None


def test_the_program_is_the_last_block_in_a_judged_language():
    """Issue 46, item 5: the tag says the language (before: every block ran as Python)."""
    assert last_program("```python\nprint(1)\n```\nthen\n```\nprint(2)\n```") == ("python", "print(2)\n")
    for tag in ("cpp", "C++", "c++", "cxx", "cc"):
        assert last_program(f"```{tag}\nint main(){{}}\n```") == ("cpp", "int main(){}\n")
    for tag in ("py", "Python3", "python title=x"):
        assert last_program(f"```{tag}\nprint(1)\n```") == ("python", "print(1)\n")
    # other languages (and C++ when it is not judged) are passed over: the Python block before them is the program
    response = ("```python\nprint(1)\n```\nsample run:\n```text\n1\n```\n```java\nclass A {}\n```\n"
                "```cpp\nint main(){}\n```")
    assert last_program(response, ["python"]) == ("python", "print(1)\n")
    assert last_program(response) == ("cpp", "int main(){}\n")
    assert last_program("```java\nclass A {}\n```") is None and last_program("no code") is None


def test_training_subset_all_tests_and_fraction(monkeypatch):
    from gspo_mcore.rewards import code

    # every response that passes its subset is checked
    monkeypatch.setattr(code, "SETTINGS", CodeRewardConfig(hack_check_share=1.0))
    tests = tuple(Test(f"{i} {i}\n", f"{2 * i}\n") for i in range(40))
    problem = Problem("stdin", tests)
    subset = training_tests(problem)
    assert len(subset) == 16 and subset == training_tests(problem)  # deterministic
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

@pytest.mark.slow  # the scoring command in subprocesses
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
    from gspo_mcore.tasks.code import OPERATIONS, expressions, make_prompts, program_rewards, vocabulary

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


# ---- reward.code: infrastructure errors, limits, settings

DIVISOR_CHECKER = ("def check(input, output, expected):\n    n, d = int(input), int(output)\n"
                   "    return 1 < d < n and n % d == 0\n")


def broken_checker_answer() -> str:
    """A problem whose checker raises: judging an output that is not the listed one is an
    infrastructure error (the grader failed, not the program)."""
    record = {"input_output": {"inputs": ["12\n"], "outputs": ["2\n"]},
              "checker": "def check(i, o, e):\n    raise ValueError('checker bug')\n"}
    return answer_from_problem(problem_from_record(record, "t:1"))


@pytest.mark.parametrize("mode", ["zero", "mask"])
def test_an_infrastructure_error_scores_zero_or_is_masked_as_reward_code_says(mode):
    """It raised before: the runner counted it as a reward error and scored 0 (and a batched
    group lost every other response's score with it)."""
    from gspo_mcore.rewards.runner import RewardRunner

    answers = [broken_checker_answer(), answer_from_problem(Problem("stdin", (Test("1 2\n", "3\n"),)))]
    responses = ["```python\nprint(3)\n```", ADD]
    runner = RewardRunner("code", timeout_s=60.0, workers=1, options={"infrastructure_errors": mode},
                          masking=mode == "mask")
    try:
        rewards, stats = runner.score(responses, answers)
    finally:
        runner.close()
    assert rewards == [None if mode == "mask" else 0.0, 1.0]
    assert (stats.errors, stats.masked) == (0, 1 if mode == "mask" else 0)
    assert stats.metrics["code_infrastructure_errors"] == 1  # counted apart from wrong answers either way

    group = RewardRunner("gspo_mcore.rewards.code:code_group_reward", timeout_s=60.0, workers=1, batched=True,
                         options={"infrastructure_errors": mode}, masking=True)
    try:  # a prompt's group: the other responses keep their scores
        rewards, stats = group.score(["```python\nprint(2)\n```", "```python\nprint(3)\n```"],
                                     [answers[0]] * 2, groups=[0, 0])
    finally:
        group.close()
    assert rewards == [1.0, None if mode == "mask" else 0.0] and stats.errors == 0
    if mode == "mask":  # a runner that does not mask (evaluation: pass@k needs every sample) scores it 0
        evaluation = RewardRunner("code_all", timeout_s=60.0, workers=1, options={"infrastructure_errors": mode})
        try:
            rewards, stats = evaluation.score(responses, answers)
        finally:
            evaluation.close()
        assert rewards == [0.0, 1.0] and stats.masked == 1


def test_a_masked_response_leaves_its_group_before_the_advantages(tmp_path):
    """reward.code.infrastructure_errors: mask: a response the reward returned None for neither
    scores 0 nor trains; the rest of its group is normalised without it."""
    from gspo_mcore.tasks.toy import make_prompts, make_tokenizer
    from helpers import GROUP, source_for

    make_tokenizer(tmp_path / "tokenizer")
    make_prompts(tmp_path / "prompts.jsonl", 64, seed=0)
    source, _ = source_for(tmp_path, "reward.code.infrastructure_errors=mask", "reward.max_error_fraction=0.5",
                           rollout_batch_size=2)
    real = source.rewards.score

    def one_infrastructure_error_per_group(*args):  # the code reward's None, on a toy task's rewards
        rewards, stats = real(*args)
        stats.masked += sum(1 for i in range(len(rewards)) if i % GROUP == 1)
        return [None if i % GROUP == 1 else r for i, r in enumerate(rewards)], stats

    source.rewards.score = one_infrastructure_error_per_group
    try:
        kept, advantages, figures = source.round(wanted=8, num_prompts=8)
    finally:
        source.close()
    assert figures["requests"] == 8 * GROUP and len(figures["rewards"]) == 8 * (GROUP - 1)
    assert figures["groups_kept"] >= 1 and len(kept) == figures["groups_kept"] * (GROUP - 1)
    for start in range(0, len(kept), GROUP - 1):  # a color group: members 0, 2 right, 3 wrong; 1 masked
        rewards = [r.reward for r in kept[start:start + GROUP - 1]]
        assert rewards == [1.0, 1.0, 0.0]
        assert sum(advantages[start:start + GROUP - 1]) == pytest.approx(0.0, abs=1e-5)
        assert advantages[start] > 0 > advantages[start + 2]


def test_limits_come_from_reward_code_and_the_datasets_own_time_limits():
    from gspo_mcore.rewards.code import limits_for, reward_options, time_limit

    settings = CodeRewardConfig(cpu_s=2.0, wall_s=6.0, memory_mb=256, dataset_time_factor=1.5)
    plain = Problem("stdin", (Test("1 2\n", "3\n"),))
    assert limits_for(plain, settings) == Limits(cpu_s=2.0, wall_s=6.0, memory_bytes=256 * 1024**2)
    contest = {"description": "x", "public_tests": {"input": ["1 2\n"], "output": ["3\n"]},
               "time_limit": {"seconds": 1, "nanos": 500000000}}
    problem = problem_from_record(contest, "cc:1")
    assert problem.time_limit_s == 1.5
    assert problem_from_record({"answer": answer_from_problem(problem)}, "cc:1") == problem  # prepare_code keeps it
    assert limits_for(problem, settings) == Limits(cpu_s=2.25, wall_s=6.75, memory_bytes=256 * 1024**2)
    assert limits_for(problem, CodeRewardConfig(dataset_time_limits=False)).cpu_s == 4.0
    for value, seconds in (("2 seconds", 2.0), ("1.5 seconds", 1.5), ("500 ms", 0.5), ("None", None), (None, None),
                           (3, 3.0)):
        assert time_limit({"time_limit": value}, "taco:1") == seconds
    with pytest.raises(InputError, match="^taco:2: field 'time_limit': seconds per test"):
        time_limit({"time_limit": "fast"}, "taco:2")
    with pytest.raises(InputError, match="^taco:3: field 'time_limit_s'"):
        time_limit({"time_limit_s": -1}, "taco:3")

    # A program past the problem's own limit (0.5 s of CPU; the default is 4 s) is a timeout.
    quick = problem_from_record({**contest, "time_limit_s": 0.5}, "cc:2")
    spin = "```python\nimport time\nt = time.process_time()\nwhile time.process_time() - t < 1.3:\n    pass\nprint(3)\n```"
    assert score(spin, quick, settings=CodeRewardConfig()).verdicts == ["timeout"]
    # Its wall-clock limit wide: at a load of 11-14 on two cores the 1.3 s of CPU once took over 8 s.
    assert score(spin, quick, settings=CodeRewardConfig(dataset_time_limits=False, wall_s=30.0)).verdicts == ["passed"]
    with pytest.raises(InputError, match=r"^reward.code.wall_s: must be >= cpu_s \(4\)$"):
        reward_options({"wall_s": 2.0})


@pytest.mark.parametrize("override, said", [
    ("reward.code.infrastructure_errors=drop", "reward.code.infrastructure_errors: 'drop' is not one of"),
    ("reward.code.max_train_tests=0", "reward.code.max_train_tests: must be >= 1"),
    ("reward.code.hack_check_share=1.5", "reward.code.hack_check_share: must be in [0, 1]"),
    ("reward.code.cpu_s=0", "reward.code.cpu_s: must be > 0"),
    ("reward.code.wall_s=1", "reward.code.wall_s: must be >= cpu_s (4)"),
    ("reward.code.memory_mb=16", "reward.code.memory_mb: must be >= 64"),
    ("reward.code.output_mb=0", "reward.code.output_mb: must be in [1, 1024]"),
    ("reward.code.dataset_time_factor=0", "reward.code.dataset_time_factor: must be > 0"),
    ("reward.code.scoring=best", "reward.code.scoring: 'best' is not one of"),
    ("reward.code.languages=[python,java]", "reward.code.languages[1]: 'java' is not one of ['python', 'cpp']"),
    ("reward.code.languages=[]", "reward.code.languages: [] must be a non-empty list of ['python', 'cpp']"),
    ("reward.code.compile_cpu_s=0", "reward.code.compile_cpu_s: must be > 0"),
    ("reward.code.compile_memory_mb=64", "reward.code.compile_memory_mb: must be >= 256"),
])
def test_bad_reward_code_values_are_one_line(override, said):
    from gspo_mcore.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="^" + re.escape(said)):
        load_config(None, [override]).validate()


# ---- verl's code rows; a dataset the reward cannot read, refused at data load

VERL_TRUTH = {"inputs": ["1 2\n", "5 7\n"], "outputs": ["3\n", "12\n"]}


@pytest.mark.parametrize("as_text", [True, False])
def test_verl_code_rows_train_as_they_are_and_prepare(tmp_path, as_text):
    """verl's prime_code reads `reward_model.ground_truth` as APPS's {inputs, outputs[, fn_name]},
    a JSON string or an object: prepare_code refused the row and the reward its answer."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from gspo_mcore.data import PromptDataset

    truth = json.dumps(VERL_TRUTH) if as_text else VERL_TRUTH
    chat = [{"role": "user", "content": "Read a and b, print a + b."}]
    row = {"data_source": "codecontests", "prompt": chat, "ability": "code",
           "reward_model": {"style": "rule", "ground_truth": truth}, "extra_info": {"index": 0}}
    pq.write_table(pa.Table.from_pylist([row]), tmp_path / "verl.parquet")
    sample = PromptDataset.load(tmp_path / "verl.parquet")[0]  # the answer: the ground truth
    assert code_reward(ADD, sample.answer) == 1.0 and code_reward(WRONG, sample.answer) == 0.0
    assert prepare(tmp_path / "verl.parquet", tmp_path / "prompts.jsonl") == 1
    prepared = json.loads((tmp_path / "prompts.jsonl").read_text())
    assert prepared["messages"] == chat and "reward_model" not in prepared and prepared["ability"] == "code"
    assert code_reward(ADD, prepared["answer"]) == 1.0
    call = {"inputs": [[2, 3]], "outputs": [5], "fn_name": "add"}
    assert score("```python\ndef add(a, b):\n    return a + b\n```",
                 problem_from_record({"reward_model": {"ground_truth": json.dumps(call)}}, "v:1")).passed


@pytest.mark.parametrize("truth, said", [
    ("72", "v:1: field 'reward_model.ground_truth': expected {inputs: [...], outputs: [...]}"),
    ({"inputs": ["1"], "outputs": []}, "v:1: field 'reward_model.ground_truth': expected {inputs"),
    (None, "v:1: field 'reward_model.ground_truth': missing"),
])
def test_a_verl_row_whose_tests_cannot_be_read_is_named(truth, said):
    with pytest.raises(InputError) as refused:
        problem_from_record({"reward_model": {"style": "rule", "ground_truth": truth}}, "v:1")
    assert str(refused.value).startswith(said) and "\n" not in str(refused.value)


@pytest.mark.parametrize("reward", ["code", "gspo_mcore.rewards.code:code_group_reward", "eval"])
def test_a_code_dataset_the_reward_cannot_read_is_refused_at_data_load(tmp_path, reward):
    """It was refused by the first reward call, after the servers started (SGLang's minutes): now
    the rollout source (and the evaluation) read every answer as the reward will, before."""
    from gspo_mcore.config import load_config
    from gspo_mcore.evaluation.held_out import Evaluator
    from gspo_mcore.rollout.source import RolloutSource
    from gspo_mcore.tasks.toy import make_tokenizer

    make_tokenizer(tmp_path / "tokenizer")
    good = answer_from_problem(Problem("stdin", (Test("1 2\n", "3\n"),)))
    rows = [{"prompt": "add", "answer": good}, {"prompt": "add", "answer": "72"}]  # a math row among code rows
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "ok.jsonl").write_text(json.dumps(rows[0]) + "\n")
    overrides = [f"data.tokenizer_dir={tmp_path / 'tokenizer'}", "reward.workers=1"]
    if reward == "eval":  # training's data is fine, an eval dataset's is not
        overrides += [f"data.path={tmp_path / 'ok.jsonl'}", "reward.name=code",
                      f"eval.datasets=[{{name: held, path: {tmp_path / 'd.jsonl'}, reward: code_all}}]"]
    else:
        overrides += [f"data.path={tmp_path / 'd.jsonl'}", f"reward.name={reward}",
                      f"reward.batched={str(reward != 'code').lower()}"]
    config = load_config(None, overrides)
    with pytest.raises(InputError) as refused:
        source = RolloutSource(config)
        try:
            Evaluator(config, source.tokenizer, source.generator).close()
        finally:
            source.close()
    assert str(refused.value).startswith(f"{tmp_path / 'd.jsonl'}:2: field 'answer': not a code problem")
    source = RolloutSource(load_config(None, [*overrides[:2], f"data.path={tmp_path / 'ok.jsonl'}", "reward.name=code"]))
    source.close()  # a readable dataset starts


# ---- the scoring command: references, settings, empty input, its name

def _scoring(argv, capsys) -> tuple[int, list[dict], str]:
    from gspo_mcore.common.errors import run_cli
    from gspo_mcore.rewards.code import main

    code = run_cli(lambda: main(argv))
    out, err = capsys.readouterr()
    return code, [json.loads(line) for line in out.splitlines()], err


def test_references_skip_and_count_problems_without_a_python3_solution(tmp_path, capsys):
    """A CodeContests problem with only C++ (and Python 2) solutions aborted the whole set with
    "field 'solutions': missing or not text"."""
    cpp_only = {"description": "Add.", "public_tests": {"input": ["1 2\n"], "output": ["3\n"]},
                "solutions": {"language": [2, 1], "solution": ["int main(){}", "print 3"]}}
    python3 = {**cpp_only, "solutions": {"language": [2, 3], "solution": ["int main(){}", "print(3)"]}}
    rows = tmp_path / "cc.jsonl"
    rows.write_text(json.dumps(cpp_only) + "\n" + json.dumps(python3) + "\n")
    code, lines, err = _scoring(["--input", str(rows), "--references"], capsys)
    assert code == 0 and [(x["row"], x["passed"]) for x in lines] == [(f"{rows}:2", True)]
    assert f"1/1 passed; 1 problems skipped, no Python 3 reference solution (the first: {rows}:1)" in err
    rows.write_text(json.dumps(cpp_only) + "\n")
    code, lines, err = _scoring(["--input", str(rows), "--references"], capsys)
    assert code == 2 and lines == [] and "none of its 1 problems has a Python 3 reference solution" in err


def test_the_scoring_command_takes_reward_code_settings_and_refuses_an_empty_file(tmp_path, capsys):
    half = "```python\na, b = map(int, input().split())\nprint(3)\n```"  # right on 1 2, wrong on 5 7
    rows = tmp_path / "r.jsonl"
    rows.write_text(json.dumps({"input_output": VERL_TRUTH, "response": half}) + "\n")
    code, lines, _ = _scoring(["--input", str(rows)], capsys)
    assert code == 0 and lines[0]["reward"] == 0.0
    code, lines, _ = _scoring(["--input", str(rows), "--scoring", "fraction", "--cpu-s", "2", "--wall-s", "4"], capsys)
    assert code == 0 and lines[0]["reward"] == 0.5
    code, _, err = _scoring(["--input", str(rows), "--wall-s", "1"], capsys)
    assert code == 2 and err.strip().endswith("reward.code.wall_s: must be >= cpu_s (4)")
    cpp = '```cpp\n#include <cstdio>\nint main() { int a, b; scanf("%d %d", &a, &b); printf("%d\\n", a + b); }\n```'
    rows.write_text(json.dumps({"input_output": VERL_TRUTH, "response": cpp}) + "\n")
    code, lines, _ = _scoring(["--input", str(rows)], capsys)
    assert code == 0 and lines[0]["verdicts"] == ["passed", "passed"]
    code, lines, _ = _scoring(["--input", str(rows), "--languages", "python"], capsys)
    assert code == 0 and lines[0]["no_program"]
    (tmp_path / "empty.jsonl").write_text("")
    code, lines, err = _scoring(["--input", str(tmp_path / "empty.jsonl")], capsys)
    assert code == 2 and lines == [] and err.strip().endswith(f"{tmp_path / 'empty.jsonl'}: no records")
    assert "0/0" not in err
    from gspo_mcore.rewards.code import main

    with pytest.raises(SystemExit):
        main(["--help"])
    said = capsys.readouterr().out
    assert said.startswith("usage: python -m gspo_mcore.rewards.code") and "--memory-mb" in said
    assert "--subset" in said and "--all" not in said and "--infrastructure-errors" not in said


def test_the_python_tool_tells_the_model_a_nonzero_exit_status():
    from gspo_mcore.tools import python as tool

    said = tool.python("import sys\nprint('half done')\nsys.exit(3)")
    assert said.startswith("half done\n") and said.endswith("\nerror: the program exited with status 3")
    assert tool.python("print(1)") == "1"  # a clean exit says nothing more


def test_explain_says_why_each_row_scored_what_it_did(tmp_path, capsys):
    """`--explain` / `-v`: the first test not passed with its verdict, the program's exit, its
    stderr's end, got and expected; the compiler's messages; or why nothing ran (old: the
    verdicts alone, `runtime_error`, `compile_error`)."""
    from gspo_mcore.rewards.code import main

    problem = {"input_output": {"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7\n"]}}
    responses = ["```python\nprint(sum(map(int, input().split())))\n```",
                 "```python\na, b = map(int, input().split())\nprint(a - b)\n```",
                 "```python\nraise KeyError('the missing key')\n```",
                 "```cpp\nint main() { return undeclared_name; }\n```",
                 "no code here"]
    inputs = tmp_path / "rows.jsonl"
    inputs.write_text("".join(json.dumps({**problem, "response": r}) + "\n" for r in responses))
    assert main(["--input", str(inputs), "--explain"]) == 0
    right, wrong, raised, built, none = (json.loads(line)["why"] for line in capsys.readouterr().out.splitlines())
    assert right is None
    assert (wrong["test"], wrong["verdict"], wrong["got"], wrong["expected"]) == (0, "wrong", "-1\n", "3\n")
    assert raised["verdict"] == "runtime_error" and raised["exit_code"] == 1 and "the missing key" in raised["stderr"]
    assert built["verdict"] == "compile_error" and "undeclared_name" in built["compiler"]
    assert none.startswith("no program")


@pytest.mark.parametrize("batched", [False, True])
def test_the_code_rewards_reasons_come_back_from_its_workers_with_the_rewards(batched):
    """The reasons --explain prints reached nothing a run writes: the worker now sends the
    reward's reward_reasons() with each reply, by response (one per call, or a group's)."""
    from dataclasses import asdict

    from gspo_mcore.rewards.runner import RewardRunner

    answer = answer_from_problem(Problem("stdin", (Test("1 2\n", "3\n"), Test("5 7\n", "12\n"))))
    responses = ["```python\nprint(sum(map(int, input().split())))\n```", "```python\nprint(3)\n```",
                 "I would add them."]
    name = "gspo_mcore.rewards.code:code_group_reward" if batched else "code"
    runner = RewardRunner(name, timeout_s=60, workers=1, batched=batched, options=asdict(CodeRewardConfig()))
    try:
        rewards, stats = runner.score(responses, [answer] * 3, groups=[0] * 3)
    finally:
        runner.close()
    assert rewards == [1.0, 0.0, 0.0] and sorted(stats.reasons) == [1, 2]
    wrong = stats.reasons[1]
    assert (wrong["test"], wrong["verdict"], wrong["got"], wrong["expected"]) == (1, "wrong", "3\n", "12\n")
    assert stats.reasons[2].startswith("no program")
