"""`reward.name: code`: the response's last fenced code block in a judged language (Python, C++),
run on the problem's tests in the sandbox (gspo_mcore.sandbox), judged on the host.

The tests come from the record's `answer`, which `python -m gspo_mcore.data.prepare_code` writes
(`{"kind", "func_name", "tolerance", "tests": [[input, output], ...]}`) from the public formats that
`problem_from_record` reads: LiveCodeBench `code_generation_lite` (`public_test_cases`,
`private_test_cases`, the latter also as released: base64 -> zlib -> pickle of a JSON string,
decoded by an unpickler that admits a str and nothing else), TACO / APPS `input_output`,
CodeContests `public_tests` / `private_tests` / `generated_tests`, PrimeIntellect
`verification_info`, verl's `reward_model.ground_truth` (prime_code's `{"inputs", "outputs"[, "fn_name"]}`,
APPS's object, as a JSON string or an object; also accepted as `answer` itself, so a verl Parquet
file trains as it is).

The program is the response's last fenced block in a judged language (`reward.code.languages`:
Python, ```python / ```py / untagged; C++, ```cpp / ```c++, compiled in the sandbox); blocks in
other languages are passed over.

Settings: `reward.code` (gspo_mcore.rewards.code_config.CodeRewardConfig), handed to each
reward worker by `reward_options`; the defaults elsewhere (the scoring command, evaluation).
Scoring: 1 when every test run passes, else 0 (`scoring: fraction`: the share passed). `code`
(training) runs a deterministic subset of at most `max_train_tests` tests (the first in an order
fixed by each input's hash) and stops at the first failure; `code_all` (evaluation) runs every
test. No code block: 0, counted. An infrastructure error is never a pass: counted, and scored 0 or
returned as None (masked from the batch by the rollout source), as `infrastructure_errors` says.
A share (`hack_check_share`) of the responses that pass the training subset also run the rest:
the ones that then fail are the hack rate. Each test runs under `cpu_s` / `wall_s` /
`memory_mb`, or the problem's own time limit where its dataset gives one.

    python -m gspo_mcore.rewards.code --input F.jsonl [--output G.jsonl] [--references] [--subset]
                                      [--cpu-s S --wall-s S --memory-mb M --scoring fraction ...]
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import hashlib
import io
import json
import pickle
import re
import sys
import typing
import zlib
from dataclasses import dataclass, field

from gspo_mcore.common.errors import InputError, run_cli
from gspo_mcore.rewards.code_config import CodeRewardConfig
from gspo_mcore.sandbox import Judgement, Limits, Problem, Test, check_languages, check_sandbox, judge
from gspo_mcore.sandbox.judge import judge_programs

SETTINGS = CodeRewardConfig()  # this process's reward.code (a reward worker's, from reward_options)
FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
# A fence's tag (lower case) -> the language its block is judged in (reward.code.languages)
LANGUAGE_TAGS = {"": "python", "python": "python", "python3": "python", "py": "python", "py3": "python",
                 "cpp": "cpp", "c++": "cpp", "cxx": "cpp", "cc": "cpp"}


# ---- reading the public formats

class _StrOnly(pickle.Unpickler):
    def find_class(self, module, name):  # every global (a class, a function: code to run) is refused
        raise pickle.UnpicklingError(f"refused global {module}.{name}")


def decode_lcb_tests(text: str, where: str) -> list:
    """LiveCodeBench's test cases: a JSON list, or the released base64 -> zlib -> pickle -> JSON
    string. The pickle may hold a str only: anything else is refused before it is built."""
    text = text.strip()
    if not text.startswith("["):
        try:
            raw = zlib.decompress(base64.b64decode(text, validate=True))
            decoded = _StrOnly(io.BytesIO(raw)).load()
        except (ValueError, zlib.error, pickle.UnpicklingError, EOFError) as err:
            raise InputError(f"{where}: not a JSON list nor base64-zlib-pickle of one ({err})") from None
        if type(decoded) is not str:
            raise InputError(f"{where}: its pickle holds a {type(decoded).__name__}, not a str (refused)")
        text = decoded
    try:
        cases = json.loads(text)
    except ValueError as err:
        raise InputError(f"{where}: not JSON ({err})") from None
    if not isinstance(cases, list) or not all(isinstance(c, dict) and {"input", "output"} <= set(c) for c in cases):
        raise InputError(f"{where}: expected a list of {{input, output, testtype}}")
    return cases


def _as_json(value, where: str):
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError as err:
            raise InputError(f"{where}: not JSON ({err})") from None
    return value


def _lines(value) -> str:
    return "\n".join(map(str, value)) if isinstance(value, list) else str(value)


def _lcb(record: dict, where: str) -> Problem:
    cases = []
    for key in ("public_test_cases", "private_test_cases"):
        if record.get(key):
            cases += decode_lcb_tests(record[key], f"{where}: field '{key}'")
    functional = any(c.get("testtype") == "functional" for c in cases)
    if not functional:
        return Problem("stdin", tuple(Test(str(c["input"]), str(c["output"])) for c in cases))
    metadata = _as_json(record.get("metadata") or "{}", f"{where}: field 'metadata'")
    if not isinstance(metadata, dict) or not metadata.get("func_name"):
        raise InputError(f"{where}: field 'metadata': functional tests need metadata.func_name")
    tests = []
    for case in cases:  # one JSON value per line: the call's arguments
        try:
            arguments = [json.loads(line) for line in str(case["input"]).split("\n") if line.strip()]
        except ValueError as err:
            raise InputError(f"{where}: field 'public_test_cases'/'private_test_cases': a functional input "
                             f"is not JSON lines ({err})") from None
        tests.append(Test(json.dumps(arguments), str(case["output"])))
    return Problem("functional", tuple(tests), metadata["func_name"])


def _in_outs(spec, where: str) -> Problem:
    """APPS / TACO's `input_output` object (`inputs`, `outputs`, `fn_name` for call-based
    problems); verl's prime_code reads its ground truth in the same shape. `where` names the field."""
    if not isinstance(spec, dict) or not isinstance(spec.get("inputs"), list) \
            or not isinstance(spec.get("outputs"), list) or len(spec["inputs"]) != len(spec["outputs"]):
        raise InputError(f"{where}: expected {{inputs: [...], outputs: [...]}} of equal length")
    if spec.get("fn_name"):
        tests = tuple(Test(json.dumps(i if isinstance(i, list) else [i]), json.dumps(o))
                      for i, o in zip(spec["inputs"], spec["outputs"]))
        return Problem("functional", tests, spec["fn_name"])
    return Problem("stdin", tuple(Test(_lines(i), _lines(o)) for i, o in zip(spec["inputs"], spec["outputs"])))


def _taco(record: dict, where: str) -> Problem:
    return _in_outs(_as_json(record["input_output"], f"{where}: field 'input_output'"), f"{where}: field 'input_output'")


def _verl(record: dict, where: str) -> Problem:
    """verl's row: `reward_model: {style, ground_truth}`, the ground truth prime_code's tests."""
    where = f"{where}: field 'reward_model.ground_truth'"
    model = record["reward_model"]
    if not isinstance(model, dict) or model.get("ground_truth") is None:
        raise InputError(f"{where}: missing")
    return _in_outs(_as_json(model["ground_truth"], where), where)


def _code_contests(record: dict, where: str) -> Problem:
    tests = []
    for key in ("public_tests", "private_tests", "generated_tests"):
        block = _as_json(record.get(key) or {"input": [], "output": []}, f"{where}: field '{key}'")
        if not isinstance(block, dict) or len(block.get("input", [])) != len(block.get("output", [])):
            raise InputError(f"{where}: field '{key}': expected {{input: [...], output: [...]}} of equal length")
        tests += [Test(str(i), str(o)) for i, o in zip(block["input"], block["output"])]
    return Problem("stdin", tuple(tests))


def _verification_info(record: dict, where: str) -> Problem:
    info = _as_json(record["verification_info"], f"{where}: field 'verification_info'")
    cases = info.get("test_cases") if isinstance(info, dict) else None
    if not isinstance(cases, list) or not cases:
        raise InputError(f"{where}: field 'verification_info': no test_cases")
    kinds = {c.get("type") for c in cases if isinstance(c, dict)}
    if kinds == {"stdin_stdout"}:
        return Problem("stdin", tuple(Test(_lines(c["input"]), _lines(c["output"])) for c in cases))
    if kinds == {"function_call"} and len({c.get("fn_name") for c in cases}) == 1 and cases[0].get("fn_name"):
        tests = []
        for case in cases:
            arguments = _as_json(case["input"], f"{where}: field 'verification_info'")
            tests.append(Test(json.dumps(arguments if isinstance(arguments, list) else [arguments]),
                              json.dumps(_as_json(case["output"], f"{where}: field 'verification_info'"))))
        return Problem("functional", tuple(tests), cases[0]["fn_name"])
    raise InputError(f"{where}: field 'verification_info': test_cases of types {sorted(map(str, kinds))} "
                     "(expected all stdin_stdout, or all function_call of one fn_name)")


FORMATS = (("public_test_cases", _lcb), ("private_test_cases", _lcb), ("input_output", _taco),
           ("public_tests", _code_contests), ("verification_info", _verification_info), ("reward_model", _verl))
# Problem.origin of each format: how its outputs compare (sandbox.judge: LiveCodeBench's own number
# rule; APPS's `[value]` accepting `value`, which verl's prime_code, an APPS grader, applies too)
ORIGINS = {_lcb: "livecodebench", _taco: "taco", _verl: "taco", _code_contests: "codecontests",
           _verification_info: "primeintellect"}


def problem_from_record(record: dict, where: str) -> Problem:
    """The record's tests, in whichever public format it has; `answer` as prepare_code writes it
    first. One-line InputError naming the row and the field otherwise."""
    if not isinstance(record, dict):
        raise InputError(f"{where}: expected an object")
    if isinstance(record.get("answer"), str) and record["answer"].lstrip().startswith("{"):
        return problem_from_answer(record["answer"], where)
    for key, read in FORMATS:
        if record.get(key):
            try:
                problem = read(record, where)
            except (KeyError, TypeError, AttributeError) as err:
                raise InputError(f"{where}: field '{key}': malformed ({type(err).__name__}: {err})") from None
            if not problem.tests:
                raise InputError(f"{where}: field '{key}': no tests")
            return _with_judging_fields(dataclasses.replace(problem, origin=ORIGINS[read]), record, where)
    raise InputError(f"{where}: no tests: none of the fields answer, {', '.join(k for k, _ in FORMATS)}")


TIME_LIMIT = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(ms|milliseconds?|s|secs?|seconds?)?\s*", re.IGNORECASE)


def time_limit(record: dict, where: str) -> float | None:
    """A row's time limit per test in seconds: `time_limit_s` (a number), or `time_limit` as
    CodeContests gives it (`{seconds, nanos}`) or TACO (`"2 seconds"`, `"1.5 seconds"`; `"None"`);
    None when it gives none."""
    if record.get("time_limit_s") is not None:
        value, key = record["time_limit_s"], "time_limit_s"
    else:
        value, key = record.get("time_limit"), "time_limit"
        if isinstance(value, str) and value.strip() in ("", "None", "null"):
            value = None
        if isinstance(value, str) and TIME_LIMIT.fullmatch(value):
            number, unit = TIME_LIMIT.fullmatch(value).groups()
            value = float(number) / (1000 if unit and unit.lower().startswith("m") else 1)
        elif isinstance(value, dict) and set(value) <= {"seconds", "nanos"}:
            seconds = value.get("seconds") or 0
            value = seconds + (value.get("nanos") or 0) / 1e9 if seconds or value.get("nanos") else None
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 3600:
        raise InputError(f"{where}: field '{key}': seconds per test (a number, {{seconds, nanos}} or "
                         f"'N seconds'), got {str(value)[:80]!r}")
    return float(value)


def _with_judging_fields(problem: Problem, record: dict, where: str) -> Problem:
    """A record's own `checker` (Python source of `check(input, output, expected) -> bool`),
    `tolerance` (numbers compared within it) and time limit, whatever its format."""
    checker, tolerance = record.get("checker"), record.get("tolerance")
    if checker is not None and (not isinstance(checker, str) or "def check(" not in checker):
        raise InputError(f"{where}: field 'checker': Python source defining check(input, output, expected)")
    if checker is not None and problem.kind != "stdin":
        raise InputError(f"{where}: field 'checker': for stdin problems only")
    if tolerance is not None and (isinstance(tolerance, bool) or not isinstance(tolerance, (int, float))
                                  or not 0 <= tolerance < 1):
        raise InputError(f"{where}: field 'tolerance': a number in [0, 1)")
    return dataclasses.replace(problem, checker=checker, tolerance=tolerance,
                               time_limit_s=time_limit(record, where))


def answer_from_problem(problem: Problem) -> str:
    return json.dumps({"kind": problem.kind, "func_name": problem.func_name, "tolerance": problem.tolerance,
                       "checker": problem.checker, "time_limit_s": problem.time_limit_s, "origin": problem.origin,
                       "tests": [[t.input, t.output] for t in problem.tests]})


def problem_from_answer(answer: str, where: str = "answer") -> Problem:
    """The reward's answer: as prepare_code writes it, or verl's prime_code ground truth
    (`{"inputs", "outputs"[, "fn_name"]}`: a verl Parquet's `reward_model.ground_truth`, which
    PromptDataset takes as the answer). One-line InputError naming `where` otherwise."""
    try:
        spec = json.loads(answer)
    except (ValueError, TypeError) as err:
        raise InputError(f"{where}: field 'answer': not JSON ({type(err).__name__}: {err})") from None
    if isinstance(spec, dict) and "tests" not in spec and "inputs" in spec:
        problem = _in_outs(spec, f"{where}: field 'answer' (verl's ground truth)")
        if not problem.tests:
            raise InputError(f"{where}: field 'answer' (verl's ground truth): no tests")
        return _with_judging_fields(dataclasses.replace(problem, origin="taco"), spec, where)
    try:
        tests = tuple(Test(str(i), str(o)) for i, o in spec["tests"])
        problem = Problem(spec["kind"], tests, spec.get("func_name"), spec.get("tolerance"), spec.get("checker"),
                          time_limit(spec, where), spec.get("origin"))
    except (ValueError, KeyError, TypeError) as err:
        raise InputError(f"{where}: field 'answer': not a code problem as prepare_code writes it, nor verl's "
                         f"{{inputs, outputs}} ({type(err).__name__}: {err})") from None
    if problem.kind not in ("stdin", "functional") or not tests or (problem.kind == "functional" and not problem.func_name):
        raise InputError(f"{where}: field 'answer': kind stdin|functional (with func_name) and at least one test")
    if problem.origin not in (None, *ORIGINS.values()):
        raise InputError(f"{where}: field 'answer': origin {str(problem.origin)[:40]!r} is not one of "
                         f"{sorted(set(ORIGINS.values()))}")
    return problem


# ---- scoring

def last_program(response: str, languages=("python", "cpp")) -> tuple[str, str] | None:
    """(language, source) of the last fenced block whose tag names one of `languages`
    (LANGUAGE_TAGS: untagged is Python), or None; blocks of other tags (```text, ```java, ```cpp
    when C++ is not judged) are passed over."""
    for tag, source in reversed(FENCE.findall(response)):
        if LANGUAGE_TAGS.get(tag.lower()) in languages:
            return LANGUAGE_TAGS[tag.lower()], source
    return None


def _order(problem: Problem) -> list[Test]:
    """Every test, in the deterministic order the training subset is cut from."""
    return sorted(problem.tests, key=lambda t: hashlib.sha1(t.input.encode("utf-8", "surrogateescape")).digest())


def training_tests(problem: Problem, settings: CodeRewardConfig | None = None) -> list[Test]:
    return _order(problem)[:(settings or SETTINGS).max_train_tests]


def limits_for(problem: Problem, settings: CodeRewardConfig | None = None) -> Limits:
    """A test's limits: reward.code's, the CPU time from the problem's own limit where its dataset
    gives one (and dataset_time_limits), the wall clock in the settings' ratio to it."""
    settings = settings or SETTINGS
    cpu_s = settings.cpu_s
    if settings.dataset_time_limits and problem.time_limit_s is not None:
        cpu_s = problem.time_limit_s * settings.dataset_time_factor
    return Limits(cpu_s=cpu_s, wall_s=cpu_s * settings.wall_s / settings.cpu_s,
                  memory_bytes=settings.memory_mb * 1024 * 1024, output_bytes=settings.output_mb * 1024 * 1024)


def compile_limits_for(settings: CodeRewardConfig | None = None) -> Limits:
    """A C++ program's build limits: reward.code's compile_cpu_s and compile_memory_mb."""
    settings = settings or SETTINGS
    return Limits.compile(settings.compile_cpu_s, settings.compile_memory_mb * 1024 * 1024)


def reward_options(options: dict) -> None:
    """reward.code's settings for this process (gspo_mcore.rewards.worker calls it at start)."""
    global SETTINGS
    try:
        settings = CodeRewardConfig(**options)
    except TypeError as err:
        raise InputError(f"reward.code: {err}") from None
    if settings.problem() is not None:
        raise InputError(f"reward.code.{settings.problem()}")
    SETTINGS = settings


@dataclass
class CodeStats:
    """Running totals in this process (a reward worker): take_stats() per step."""
    responses: int = 0
    no_program: int = 0
    tests_run: int = 0
    sandbox_s: float = 0.0
    infrastructure_errors: int = 0
    timeouts: int = 0
    hack_checked: int = 0
    hacks: int = 0  # passed the training subset, failed another test


STATS = CodeStats()


def take_stats() -> CodeStats:
    global STATS
    stats, STATS = STATS, CodeStats()
    return stats


def step_figures(counts: dict) -> dict:
    """A step's code figures (metric_schema's code_* rows) from the sums of its calls'
    reward_metrics(); all null when the reward reported none (not a code reward)."""
    tests, seconds, checked = counts.get("code_tests_run"), counts.get("code_sandbox_s"), counts.get("code_hack_checked")
    return {"code_tests_run": tests, "code_sandbox_s": seconds,
            "code_tests_per_s": tests / seconds if tests is not None and seconds else None,
            "code_infrastructure_errors": counts.get("code_infrastructure_errors"),
            "code_timeouts": counts.get("code_timeouts"), "code_no_program": counts.get("code_no_program"),
            "code_no_program_fraction": counts["code_no_program"] / counts["code_responses"]
            if counts.get("code_responses") else None,
            "code_hack_rate": counts["code_hacks"] / checked if checked else None}


def reward_metrics() -> dict[str, float]:
    """This worker's counts since the last call, by metric_schema's names (sums over a step's
    calls; code_tests_per_s and code_hack_rate are derived from them per step)."""
    stats = take_stats()
    return {"code_tests_run": stats.tests_run, "code_sandbox_s": stats.sandbox_s,
            "code_infrastructure_errors": stats.infrastructure_errors, "code_timeouts": stats.timeouts,
            "code_no_program": stats.no_program, "code_responses": stats.responses,
            "code_hack_checked": stats.hack_checked, "code_hacks": stats.hacks}


@dataclass
class CodeScore:
    reward: float
    passed: bool
    verdicts: list[str] = field(default_factory=list)
    no_program: bool = False
    infrastructure_error: str | None = None
    failure: dict | None = None  # why it did not pass: the judge's (sandbox.judge.Judgement.failure)


def explained(result: CodeScore) -> dict | str | None:
    """`--explain`'s reason for a score: the failure, or why there was nothing to run."""
    if result.no_program:
        return "no program: the response has no fenced code block in reward.code.languages"
    if result.infrastructure_error is not None:
        return f"infrastructure: {result.infrastructure_error}"
    return result.failure


REASONS: list = []  # the last call's, per response: explained()


def _count(judgement: Judgement) -> None:
    STATS.tests_run += sum(v != "infrastructure" for v in judgement.verdicts) if judgement.same_as is None else 0
    STATS.sandbox_s += judgement.sandbox_s
    STATS.timeouts += judgement.verdicts.count("timeout") if judgement.same_as is None else 0
    STATS.infrastructure_errors += judgement.infrastructure_error is not None


def score(response: str, problem: Problem, every_test: bool = False, fraction: bool | None = None,
          settings: CodeRewardConfig | None = None) -> CodeScore:
    return score_group([response], problem, every_test, fraction, settings)[0]


def score_group(responses: list[str], problem: Problem, every_test: bool = False, fraction: bool | None = None,
                settings: CodeRewardConfig | None = None) -> list[CodeScore]:
    """The responses to one problem (a prompt's group), each program in a sandbox of its own
    (identical programs judged once: gspo_mcore.sandbox.judge.judge_programs). `settings`: reward.code (default: this process's); `fraction` None: its `scoring`."""
    settings = settings or SETTINGS
    fraction = settings.scoring == "fraction" if fraction is None else fraction
    limits, compile_limits = limits_for(problem, settings), compile_limits_for(settings)
    STATS.responses += len(responses)
    programs = [last_program(response, settings.languages) for response in responses]
    STATS.no_program += programs.count(None)
    ordered = _order(problem)
    tests = ordered if every_test else ordered[:settings.max_train_tests]
    present = [program for program in programs if program is not None]
    judged = iter(judge_programs([source for _, source in present], problem, tests,
                                 stop_at_first_failure=not (every_test or fraction), limits=limits,
                                 languages=[language for language, _ in present],
                                 compile_limits=compile_limits) if present else [])
    scores = []
    for response, program in zip(responses, programs):
        if program is None:
            scores.append(CodeScore(0.0, False, no_program=True))
            continue
        judgement = next(judged)
        _count(judgement)
        if judgement.infrastructure_error is not None:
            scores.append(CodeScore(0.0, False, judgement.verdicts, infrastructure_error=judgement.infrastructure_error))
            continue
        passed = judgement.passed and len(judgement.verdicts) == len(tests)
        if passed and not every_test and len(ordered) > len(tests) and _hack_check(response, settings):
            rest = judge(program[1], problem, ordered[len(tests):], stop_at_first_failure=True, limits=limits,
                         language=program[0], compile_limits=compile_limits)
            _count(rest)
            if rest.infrastructure_error is None:
                STATS.hack_checked += 1
                STATS.hacks += not rest.passed
        reward = 1.0 if passed else (judgement.verdicts.count("passed") / len(tests) if fraction else 0.0)
        scores.append(CodeScore(reward, passed, judgement.verdicts, failure=judgement.failure))
    return scores


def _hack_check(response: str, settings: CodeRewardConfig) -> bool:
    return hashlib.sha1(response.encode("utf-8", "surrogateescape")).digest()[0] < 256 * settings.hack_check_share


def _results(responses: list[str], answers: list[str], every_test: bool) -> list[CodeScore]:
    """Each response judged against its answer's problem, a problem's responses as one group."""
    check_sandbox()  # once per worker: the one-line refusal where the sandbox cannot run
    check_languages(SETTINGS.languages)  # and where C++ is judged without a compiler
    if len(set(answers)) != 1:
        return [result for r, a in zip(responses, answers) for result in _results([r], [a], every_test)]
    return score_group(responses, problem_from_answer(answers[0]), every_test=every_test)


def _rewards(responses: list[str], answers: list[str], every_test: bool) -> list[float | None]:
    """A group's rewards (one problem: a batched reward gets a prompt's group). A response whose
    program met an infrastructure error (counted in STATS) scores 0, or None (`mask`: the rollout
    source drops it from its group), never a pass; its reason goes to stderr (the trainer's).
    Why each scored as it did is kept for reward_reasons()."""
    global REASONS
    results = _results(responses, answers, every_test)
    masked = SETTINGS.infrastructure_errors == "mask"
    for result in results:
        if result.infrastructure_error is not None:
            print(f"code reward: infrastructure error ({'masked' if masked else 'scored 0'}): "
                  f"{result.infrastructure_error}", file=sys.stderr, flush=True)
    REASONS = [explained(result) for result in results]
    return [None if masked and r.infrastructure_error is not None else r.reward for r in results]


def reward_reasons() -> list:
    """The worker's hook (gspo_mcore.rewards.worker): why each response of the last call scored
    as it did (explained(): the first test not passed, the build's messages, no program; None
    where it passed), which the run writes beside it in OUTPUT_DIR/samples."""
    return REASONS


def code_reward(response: str, answer: str) -> float | None:
    """Training: 1.0 if the last code block passes the problem's training subset of tests."""
    return _rewards([response], [answer], every_test=False)[0]


def code_all_reward(response: str, answer: str) -> float | None:
    """Evaluation: 1.0 if the last code block passes every test of the problem."""
    return _rewards([response], [answer], every_test=True)[0]


def code_group_reward(responses: list[str], answers: list[str]) -> list[float | None]:
    """`code` for reward.batched: true: a prompt's group in one call (each program in a sandbox of
    its own, started in the background while the previous one runs; identical programs judged
    once)."""
    return _rewards(responses, answers, every_test=False)


def reward_check_answer(answer: str, where: str) -> None:
    """A dataset row's answer read as the reward reads it (gspo_mcore.rewards.runner calls this
    hook at data load: a dataset the reward cannot read stops the run before any server starts)."""
    problem_from_answer(answer, where)


# ---- the scoring command

PYTHON3 = 3  # CodeContests' `solutions.language` code of Python 3 (1: Python 2, 2: C++, 4: Java)


def reference_solutions(record: dict) -> list[str]:
    """A dataset's own Python 3 solutions, as responses (fenced): TACO/APPS `solutions`,
    CodeContests `solutions` (language 3), PrimeIntellect `gold_standard_solution`; [] when it
    has none (many CodeContests problems have only C++ or Python 2 ones)."""
    solutions = record.get("solutions")
    if isinstance(solutions, str):
        try:
            solutions = json.loads(solutions)
        except ValueError:
            solutions = [solutions]
    if isinstance(solutions, dict):  # CodeContests: {language: [...], solution: [...]}
        solutions = [s for lang, s in zip(solutions.get("language") or [], solutions.get("solution") or [])
                     if lang == PYTHON3]
    found = [f"```python\n{s}\n```" for s in solutions or [] if isinstance(s, str)]
    if isinstance(record.get("gold_standard_solution"), str):
        found.append(record["gold_standard_solution"])
    return found


# reward.code's fields the command takes as flags; `infrastructure_errors` is not one (the command
# reports an infrastructure error on its line, it never scores one), nor `hack_check_share` (no
# training subset is checked for hacks here).
SETTING_FLAGS = tuple(f.name for f in dataclasses.fields(CodeRewardConfig)
                      if f.name not in ("infrastructure_errors", "hack_check_share"))


def _add_setting_flags(parser: argparse.ArgumentParser) -> None:
    hints, defaults = typing.get_type_hints(CodeRewardConfig), CodeRewardConfig()
    group = parser.add_argument_group("reward.code settings (as a run's config sets them; docs/13-code-rl.md)")
    for name in SETTING_FLAGS:
        default, flag = getattr(defaults, name), "--" + name.replace("_", "-")
        said = f"reward.code.{name} (default {default})"
        if isinstance(default, bool):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=said)
        elif isinstance(default, list):  # languages: each a Literal's value
            group.add_argument(flag, nargs="+", choices=typing.get_args(typing.get_args(hints[name])[0]),
                               default=default, help=said)
        elif typing.get_origin(hints[name]) is typing.Literal:
            group.add_argument(flag, choices=typing.get_args(hints[name]), default=default, help=said)
        else:
            group.add_argument(flag, type=type(default), default=default, metavar=name.split("_")[-1].upper(), help=said)


def settings_from_args(args: argparse.Namespace) -> CodeRewardConfig:
    """The flags as reward.code; a bad value is a one-line InputError naming the setting."""
    settings = CodeRewardConfig(**{name: getattr(args, name) for name in SETTING_FLAGS}, hack_check_share=0.0)
    if settings.problem() is not None:
        raise InputError(f"reward.code.{settings.problem()}")
    return settings


def _prepare_cpp(responses: list[str], settings: CodeRewardConfig) -> None:
    """Where a response is C++: g++ checked (its one line where missing) and the precompiled
    header built once per host, before the first program is judged."""
    if any((last_program(response, settings.languages) or ("",))[0] == "cpp" for response in responses):
        check_languages(["cpp"], prepare=True)


def _rows_to_score(path: str, references: bool) -> tuple[list, list[str]]:
    """Every row of `path` read before anything runs: (where, problem, responses) each, and the
    rows skipped (--references: no Python 3 solution); a bad row or an empty input is one line."""
    from gspo_mcore.common.records import read_records, require_file

    rows, skipped = [], []
    for where, record in read_records(require_file(path)):
        problem = problem_from_record(record, where)
        if references:
            responses = reference_solutions(record)
            if not responses:
                skipped.append(where)
                continue
        else:
            responses = [record.get("response")]
            if not isinstance(responses[0], str):
                raise InputError(f"{where}: field 'response': missing or not text (--references scores the "
                                 "dataset's own solutions)")
        rows.append((where, problem, responses))
    if not rows:
        raise InputError(f"{path}: no records" if not skipped else
                         f"{path}: none of its {len(skipped)} problems has a Python 3 reference solution "
                         "(TACO/APPS `solutions`, CodeContests `solutions` of language 3, PrimeIntellect "
                         "`gold_standard_solution`)")
    return rows, skipped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gspo_mcore.rewards.code",
                                     description="Score responses to code problems (or a dataset's own reference "
                                                 "solutions) in the sandbox, one JSON line each.")
    parser.add_argument("--input", required=True, help=".jsonl / .parquet: a problem in any supported format, "
                        "with `response` (the text whose last code block is judged)")
    parser.add_argument("--output", help=".jsonl to write (default: stdout)")
    parser.add_argument("--references", action="store_true",
                        help="score the dataset's own Python 3 solutions instead of `response`; problems "
                             "without one are skipped and counted")
    parser.add_argument("--subset", action="store_true", help="the training subset (reward.code.max_train_tests, "
                        "stop at the first failure); default: every test, as code_all")
    parser.add_argument("--explain", "-v", action="store_true", help="each line also says why: the first test not "
                        "passed, its verdict, the program's exit, its stderr's end, got and expected (cut), or the "
                        "compiler's messages")
    _add_setting_flags(parser)
    args = parser.parse_args(argv)
    settings = settings_from_args(args)
    from gspo_mcore.common.files import atomic_output

    rows, skipped = _rows_to_score(args.input, args.references)
    check_sandbox()
    _prepare_cpp([response for _, _, responses in rows for response in responses], settings)
    lines = []
    for where, problem, responses in rows:
        for index, response in enumerate(responses):
            result = score(response, problem, every_test=not args.subset, settings=settings)
            lines.append(json.dumps({"row": where, **({"solution": index} if args.references else {}),
                                     "reward": result.reward, "passed": result.passed, "verdicts": result.verdicts,
                                     "no_program": result.no_program,
                                     "infrastructure_error": result.infrastructure_error,
                                     **({"why": explained(result)} if args.explain else {})}))
    text = "".join(line + "\n" for line in lines)
    if args.output:
        with atomic_output(args.output) as tmp:
            with open(tmp, "w") as out:
                out.write(text)
    else:
        sys.stdout.write(text)
    passed = sum(json.loads(line)["passed"] for line in lines)
    also = (f"; {len(skipped)} problems skipped, no Python 3 reference solution (the first: {skipped[0]})"
            if skipped else "")
    print(f"{passed}/{len(lines)} passed{also}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
