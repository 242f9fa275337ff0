"""Judging on the host: each program's tests run in a sandbox of its own (a Session); what it
printed or returned is compared here, with expected outputs that never entered the sandbox (a
problem's checker program, for problems with several valid answers, runs in a sandbox of its own).

Verdicts: passed, wrong, timeout, memory, runtime_error, output_limit, compile_error (a C++
program that did not build within its compile limits, or C++ for a functional problem: its one
verdict, no test runs), infrastructure. An exit code is never a verdict on its own: a stdin
test passes only on the right output with exit status
0 (a `sys.exit(0)` after a correct answer included), a functional test only on the right value.
Whatever a program makes of its output (a result the host cannot decode or compare: nested past
the recursion limit, a number past any float or Decimal) is that test's `wrong`. An
infrastructure error (the sandbox failed to start, the harness broke) ends the judging of that
program, and of no other: the caller counts it apart and never scores it as a pass."""

from __future__ import annotations

import json
import math
import re
import signal
import time
from dataclasses import dataclass, field, replace
from decimal import Decimal, InvalidOperation
from itertools import chain, zip_longest

from gspo_mcore.sandbox.session import Limits, SandboxError, Session, TestRun

VERDICTS = ("passed", "wrong", "timeout", "memory", "runtime_error", "output_limit", "compile_error", "infrastructure")
# Output a program caused that the host cannot compare: the test's `wrong`, never an exception
# that takes its group with it.
UNCOMPARABLE = (ArithmeticError, RecursionError, ValueError)


@dataclass(frozen=True)
class Test:
    input: str  # stdin text; functional: a JSON list of the call's arguments
    output: str  # expected stdout; functional: the expected return value as JSON


@dataclass(frozen=True)
class Problem:
    kind: str  # "stdin" | "functional"
    tests: tuple[Test, ...]
    func_name: str | None = None
    tolerance: float | None = None  # relative/absolute tolerance for numbers; None: exact (Decimal) equality
    checker: str | None = None
    """Stdin problems with several valid answers: Python source defining
    `check(input: str, output: str, expected: str) -> bool`, run in a sandbox of its own (the
    candidate's sandbox never holds an expected output; the checker's never holds the candidate)."""
    time_limit_s: float | None = None
    """The dataset's own time limit per test (CodeContests, TACO), when it gives one: the code
    reward's limits scale from it (reward.code.dataset_time_limits)."""
    origin: str | None = None
    """The format the row came in (gspo_mcore.rewards.code: livecodebench, taco, codecontests,
    primeintellect): LiveCodeBench's rows keep its own number rule (any Decimal: `007` is 7),
    TACO / APPS's their `[value]` outputs that accept `value`; every other row the strict ones."""


@dataclass
class Judgement:
    verdicts: list[str] = field(default_factory=list)  # one per test run, in order
    infrastructure_error: str | None = None
    sandbox_s: float = 0.0  # wall time in the sandbox, start to close
    same_as: int | None = None  # the index of an identical program of the group whose verdicts these are
    compile_output: str | None = None  # compile_error: why (the compiler's last 2000 characters, or its limit)
    failure: dict | None = None  # the first test not passed, or the build: why (`reason`), for a person reading it

    @property
    def passed(self) -> bool:
        return bool(self.verdicts) and self.infrastructure_error is None and all(v == "passed" for v in self.verdicts)


# A number as a contest's checker reads one: ASCII digits, no leading zeros, no `_`, no `+`.
STRICT_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?", re.ASCII)


def _token_equal(got: str, want: str, tolerance: float | None, lcb_numbers: bool = False) -> bool:
    if got == want:
        return True
    if not lcb_numbers and not (STRICT_NUMBER.fullmatch(got) and STRICT_NUMBER.fullmatch(want)):
        return False
    try:
        a, b = Decimal(got), Decimal(want)
    except InvalidOperation:
        return False
    if not (a.is_finite() and b.is_finite()):
        return False
    try:
        if tolerance is None:
            return a == b
        return abs(a - b) <= Decimal(str(tolerance)) * max(Decimal(1), abs(b))
    except ArithmeticError:  # an exponent past the context's (1e9999999): no expected value is near it
        return False


def stdout_matches(got: str, want: str, tolerance: float | None = None, lcb_numbers: bool = False) -> bool:
    """LiveCodeBench's rule: the outputs stripped, split in lines, each line stripped, equal line
    by line; a line that differs as text may still match token by token as numbers: ASCII
    numbers without leading zeros, or (`lcb_numbers`, LiveCodeBench's own rows) whatever
    Python's Decimal reads, as LiveCodeBench's grader does."""
    for a, b in zip_longest(_stripped_lines(got), _stripped_lines(want)):
        if a is None or b is None:
            return False  # a line more on one side
        if a != b:
            for x, y in zip_longest(_tokens(a), _tokens(b)):
                if x is None or y is None or not _token_equal(x, y, tolerance, lcb_numbers):
                    return False
    return True


# One line at a time, its tokens split a chunk at a time: the host's memory stays a few copies of
# the output, not a string object per token of it (a 16 MiB one-line output split at once was ~470 MB).
TOKEN_CHUNK_CHARS = 1 << 16


def _tokens(line: str):
    """str.split()'s tokens of `line`, split TOKEN_CHUNK_CHARS at a time (a chunk ends at whitespace)."""
    def chunks():
        start, size = 0, len(line)
        while start < size:
            end = min(size, start + TOKEN_CHUNK_CHARS)
            while end < size and not line[end].isspace():
                end += 1
            yield line[start:end].split()
            start = end
    return chain.from_iterable(chunks())


def _stripped_lines(text: str):
    text = text.strip()
    start = 0
    while True:
        end = text.find("\n", start)
        if end == -1:
            yield text[start:].strip()
            return
        yield text[start:end].strip()
        start = end + 1


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a value")


def value_equal(got, want, tolerance: float | None = None) -> bool:
    """Structural equality of plain JSON data, type-strict for bools (True is not 1); numbers
    compare by value (1 == 1.0, as LiveCodeBench's ==), floats within `tolerance` when set."""
    if isinstance(want, bool) or isinstance(got, bool):
        return type(got) is type(want) and got == want
    if isinstance(want, (int, float)) and isinstance(got, (int, float)):
        if tolerance is not None and (isinstance(got, float) or isinstance(want, float)):
            try:
                return math.isclose(got, want, rel_tol=tolerance, abs_tol=tolerance)
            except OverflowError:  # an int past any float (10**400): not near a float that is one
                return False
        return got == want
    if isinstance(want, list) and isinstance(got, list):
        return len(got) == len(want) and all(value_equal(a, b, tolerance) for a, b in zip(got, want))
    if isinstance(want, dict) and isinstance(got, dict):
        return got.keys() == want.keys() and all(value_equal(got[k], want[k], tolerance) for k in want)
    return type(got) is type(want) and got == want  # str, None


def expected_values(output: str, unwrap: bool = False) -> list:
    """The values a functional test accepts: the JSON value, and (`unwrap`: APPS/TACO's
    convention, outputs wrapped in a list) its only element."""
    want = json.loads(output)
    return [want, want[0]] if unwrap and isinstance(want, list) and len(want) == 1 else [want]


CHECKER_WALL_FACTOR = 10.0
CHECK_DRIVER = ("\nimport json as _json, sys as _sys\n_case = _json.loads(_sys.stdin.read())\n"
                "print('checked:', check(_case['input'], _case['output'], _case['expected']) is True)\n")


class Checker:
    """A problem's checker program in its own sandbox, started at its first use. A check that
    fails (the checker raised, printed no verdict, ran out of time) on a candidate's output is
    that candidate's `wrong` when the checker accepts the expected output of the same test
    (the candidate's output is what it could not read), an infrastructure error when it does
    not (the checker is broken)."""

    def __init__(self, source: str, limits: Limits, settings=None):
        # Its time is CPU time: the wall clock at CHECKER_WALL_FACTOR x the CPU limit, so that a
        # loaded host (a candidate's next test, sent ahead, runs meanwhile) slows it without failing it.
        self.source, self.settings = source + CHECK_DRIVER, settings
        self.limits = replace(limits, wall_s=max(limits.wall_s, CHECKER_WALL_FACTOR * limits.cpu_s))
        self.session: Session | None = None
        self.sound: set[Test] = set()  # the tests whose expected output the checker accepted (never a refusal:
        # a refusal may be a moment's, and cached it would mask every later group-mate)
        self.failure = ""

    def _check(self, test: Test, output: str) -> bool | None:
        """Its verdict on `output`; None when it gave none."""
        if self.session is None:
            self.session = Session(self.source, limits=self.limits, settings=self.settings)
        try:
            run = self.session.run(json.dumps({"input": test.input, "output": output, "expected": test.output}))
        except SandboxError:
            self.close()  # a fresh one for the next check
            raise
        if run.status != "exited" or run.exit_code != 0 or not run.stdout.startswith("checked: "):
            self.failure = f"{run.status}, {run.stderr.strip()[-200:]!r}"
            return None
        return run.stdout.strip() == "checked: True"

    def accepts(self, test: Test, output: str) -> bool:
        accepted = self._check(test, output)
        if accepted is not None:
            return accepted
        failure = self.failure
        if test not in self.sound and self._check(test, test.output) is True:
            self.sound.add(test)
        if test in self.sound:
            return False
        raise SandboxError(f"sandbox: the problem's checker failed ({failure}) and does not accept the "
                           "expected output either")

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None


def verdict(run: TestRun, test: Test, problem: Problem, limits: Limits, checker: Checker | None = None) -> str:
    if run.status == "timeout" or run.cpu_s > limits.cpu_s:  # RLIMIT_CPU counts whole seconds
        return "timeout"
    if run.status == "output_limit":
        return "output_limit"
    if run.memory_killed:
        return "memory"
    if run.status == "signaled":
        if run.signal == signal.SIGXCPU or (run.signal == signal.SIGKILL and run.cpu_s >= limits.cpu_s):
            return "timeout"  # RLIMIT_CPU's signals (the kernel's tick may leave the measured time a hair short)
        return "runtime_error"
    if "MemoryError" in run.stderr[-400:]:
        return "memory"
    if run.exit_code != 0:
        return "runtime_error"
    try:
        return _compare(run, test, problem, checker)
    except UNCOMPARABLE:
        return "wrong"


def _compare(run: TestRun, test: Test, problem: Problem, checker: Checker | None) -> str:
    if problem.kind == "stdin":
        if stdout_matches(run.stdout, test.output, problem.tolerance, lcb_numbers=problem.origin == "livecodebench"):
            return "passed"
        return "passed" if checker is not None and checker.accepts(test, run.stdout) else "wrong"
    try:
        result = json.loads(run.result or "", parse_constant=_reject_constant)
    except ValueError:
        return "runtime_error"  # nothing returned (it exited before the call ended)
    if not isinstance(result, dict) or "value" not in result:
        return "wrong"  # unencodable: not plain builtin data
    return "passed" if any(value_equal(result["value"], want, problem.tolerance)
                           for want in expected_values(test.output, unwrap=problem.origin == "taco")) else "wrong"


def judge(program: str, problem: Problem, tests: list[Test] | None = None, stop_at_first_failure: bool = True,
          limits: Limits = Limits(), settings=None, language: str = "python",
          compile_limits: Limits | None = None) -> Judgement:
    """Run `tests` (default: all of the problem's) of `program` (in `language`: python | cpp) in a
    sandbox of its own."""
    return judge_programs([program], problem, tests, stop_at_first_failure, limits, settings, [language],
                          compile_limits)[0]


def judge_programs(programs: list[str], problem: Problem, tests: list[Test] | None = None,
                   stop_at_first_failure: bool = True, limits: Limits = Limits(), settings=None,
                   languages: list[str] | None = None, compile_limits: Limits | None = None) -> list[Judgement]:
    """Several programs (a prompt's group) on the same tests, each in a sandbox of its own: no
    program sees another's files, IPC, processes or PIDs, nor how far another got (stopping at
    the first failure tells nothing across sandboxes, and no sandbox's age is a group-mate's
    judging time: only the first program takes a spare). A program identical to an earlier one of
    the group (same language) is judged once: its judgement is a copy (`same_as`), no test run
    twice. A problem's checker is started once for the group. `languages`: each program's
    (default: all Python); C++ is compiled in its sandbox under `compile_limits` first."""
    tests = list(problem.tests if tests is None else tests)
    languages = list(languages or ["python"] * len(programs))
    judgements: list[Judgement] = []
    first_of: dict[tuple[str, str], int] = {}
    checker = Checker(problem.checker, limits, settings) if problem.checker and problem.kind == "stdin" else None
    try:
        for index, (program, language) in enumerate(zip(programs, languages, strict=True)):
            if (language, program) in first_of:
                first = first_of[(language, program)]
                judgements.append(replace(judgements[first], verdicts=list(judgements[first].verdicts), sandbox_s=0.0,
                                          same_as=first))
                continue
            first_of[(language, program)] = index
            # Only the group's first program takes a spare sandbox (started while an earlier group was
            # judged). A spare started while a group-mate ran has that group-mate's judging time as its
            # age (its processes' start times under /proc, its /tmp's and /dev's times), and stopping at
            # the first failure makes that time the number of tests it passed: later programs start a
            # sandbox of their own after the previous one closed, whose age is its start-up alone.
            judgements.append(_judge_one(program, problem, tests, stop_at_first_failure, limits, settings, checker,
                                         language, compile_limits, spare=not judgements))
    finally:
        if checker is not None:
            checker.close()
    return judgements


def _judge_one(program: str, problem: Problem, tests: list[Test], stop_at_first_failure: bool, limits: Limits,
               settings, checker: Checker | None, language: str = "python",
               compile_limits: Limits | None = None, spare: bool = True) -> Judgement:
    if language != "python" and problem.kind != "stdin":
        return _compile_error(Judgement(), "C++ is judged on stdin problems only: a functional problem calls "
                              f"{problem.func_name} of a Python class Solution")
    judgement = Judgement()
    started = time.monotonic()
    try:
        with Session(program, problem.kind, problem.func_name, limits, settings, spare=spare, language=language,
                     compile_limits=compile_limits) as session:
            if not session.built:
                _compile_error(judgement, _build_failure(session))
                judgement.sandbox_s = time.monotonic() - started
                return judgement
            for index, (test, run) in enumerate(zip(tests, session.runs([test.input for test in tests]))):
                judgement.verdicts.append(verdict(run, test, problem, limits, checker))
                if judgement.verdicts[-1] != "passed" and judgement.failure is None:
                    judgement.failure = reason(index, judgement.verdicts[-1], run, test, problem, limits)
                if stop_at_first_failure and judgement.verdicts[-1] != "passed":
                    break  # the next test, sent ahead, dies with the sandbox
    except SandboxError as err:
        judgement.infrastructure_error = str(err)
        judgement.verdicts.append("infrastructure")
    judgement.sandbox_s = time.monotonic() - started
    return judgement


def _compile_error(judgement: Judgement, why: str) -> Judgement:
    """`judgement` as a build that failed: its verdict, the compiler's words, and the same as its failure."""
    judgement.verdicts.append("compile_error")
    judgement.compile_output = why
    judgement.failure = {"test": None, "verdict": "compile_error", "compiler": why}
    return judgement


REASON_CHARS = 300  # of each text a reason quotes (its end for stderr, its start for outputs)


def reason(index: int, verdict_: str, run: TestRun, test: Test, problem: Problem, limits: Limits) -> dict:
    """Why test `index` was not passed, for a person triaging (`--explain`): its verdict, the
    program's exit, its stderr's end, what it printed (returned) and what was expected, each cut."""
    got = run.stdout if problem.kind == "stdin" else (run.result or "")
    why = {"test": index, "verdict": verdict_, "status": run.status, "exit_code": run.exit_code, "signal": run.signal,
           "cpu_s": run.cpu_s, "wall_s": run.wall_s, "stderr": run.stderr[-REASON_CHARS:],
           "got": got[:REASON_CHARS], "expected": test.output[:REASON_CHARS]}
    if verdict_ == "timeout":
        why["limit"] = f"cpu {limits.cpu_s:g} s, wall {limits.wall_s:g} s"
    return why


def _build_failure(session: Session) -> str:
    """Why a build failed: the compiler's messages, or which of its limits it met."""
    run, limits = session.compiled, session.compile_limits
    if run.status == "timeout" or run.cpu_s > limits.cpu_s or run.signal == signal.SIGXCPU:
        return f"the compiler ran past its limit ({limits.cpu_s:g} s CPU, {limits.wall_s:g} s wall)"
    if run.memory_killed or "memory exhausted" in run.stderr or "out of memory" in run.stderr:
        return f"the compiler ran out of memory ({limits.memory_bytes // 1024**2} MiB); {run.stderr.strip()[-1000:]}"
    if run.status == "output_limit":
        return "the compiler's output past its limit"
    said = run.stderr.strip()[-2000:]
    return said or f"the compiler {run.status} (exit {run.exit_code}, signal {run.signal})"
