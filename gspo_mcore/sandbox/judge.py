"""Judging on the host: a program's tests run in one sandbox Session; what it printed or returned
is compared here, with expected outputs that never entered the sandbox (a problem's checker program, for problems with
several valid answers, runs in a sandbox of its own).

Verdicts: passed, wrong, timeout, memory, runtime_error, infrastructure. An exit code is never a
verdict on its own: a stdin test passes only on the right output with exit status 0 (a
`sys.exit(0)` after a correct answer included), a functional test only on the right value.
An infrastructure error (the sandbox failed to start, the harness broke) ends the judging of
that program: the caller counts it apart and never scores it as a pass."""

from __future__ import annotations

import json
import math
import signal
import time
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation

from gspo_mcore.sandbox.session import Limits, SandboxError, Session, TestRun

VERDICTS = ("passed", "wrong", "timeout", "memory", "runtime_error", "infrastructure")


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


@dataclass
class Judgement:
    verdicts: list[str] = field(default_factory=list)  # one per test run, in order
    infrastructure_error: str | None = None
    sandbox_s: float = 0.0  # wall time in the sandbox, start to close

    @property
    def passed(self) -> bool:
        return bool(self.verdicts) and self.infrastructure_error is None and all(v == "passed" for v in self.verdicts)


def _token_equal(got: str, want: str, tolerance: float | None) -> bool:
    if got == want:
        return True
    try:
        a, b = Decimal(got), Decimal(want)
    except InvalidOperation:
        return False
    if not (a.is_finite() and b.is_finite()):
        return False
    if tolerance is None:
        return a == b
    return abs(a - b) <= Decimal(str(tolerance)) * max(Decimal(1), abs(b))


def stdout_matches(got: str, want: str, tolerance: float | None = None) -> bool:
    """LiveCodeBench's rule: the outputs stripped, split in lines, each line stripped, equal line
    by line; a line that differs as text may still match token by token as numbers."""
    got_lines = [line.strip() for line in got.strip().split("\n")]
    want_lines = [line.strip() for line in want.strip().split("\n")]
    if len(got_lines) != len(want_lines):
        return False
    for a, b in zip(got_lines, want_lines):
        if a != b:
            ta, tb = a.split(), b.split()
            if len(ta) != len(tb) or not all(_token_equal(x, y, tolerance) for x, y in zip(ta, tb)):
                return False
    return True


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a value")


def value_equal(got, want, tolerance: float | None = None) -> bool:
    """Structural equality of plain JSON data, type-strict for bools (True is not 1); numbers
    compare by value (1 == 1.0, as LiveCodeBench's ==), floats within `tolerance` when set."""
    if isinstance(want, bool) or isinstance(got, bool):
        return type(got) is type(want) and got == want
    if isinstance(want, (int, float)) and isinstance(got, (int, float)):
        if tolerance is not None and (isinstance(got, float) or isinstance(want, float)):
            return math.isclose(got, want, rel_tol=tolerance, abs_tol=tolerance)
        return got == want
    if isinstance(want, list) and isinstance(got, list):
        return len(got) == len(want) and all(value_equal(a, b, tolerance) for a, b in zip(got, want))
    if isinstance(want, dict) and isinstance(got, dict):
        return got.keys() == want.keys() and all(value_equal(got[k], want[k], tolerance) for k in want)
    return type(got) is type(want) and got == want  # str, None


def expected_values(output: str) -> list:
    """The values a functional test accepts: the JSON value, and (APPS/TACO's convention, outputs
    wrapped in a list) its only element."""
    want = json.loads(output)
    return [want, want[0]] if isinstance(want, list) and len(want) == 1 else [want]


CHECK_DRIVER = ("\nimport json as _json, sys as _sys\n_case = _json.loads(_sys.stdin.read())\n"
                "print('checked:', check(_case['input'], _case['output'], _case['expected']) is True)\n")


class Checker:
    """A problem's checker program in its own sandbox, started at its first use."""

    def __init__(self, source: str, limits: Limits, settings=None):
        self.source, self.limits, self.settings = source + CHECK_DRIVER, limits, settings
        self.session: Session | None = None

    def accepts(self, test: Test, output: str) -> bool:
        if self.session is None:
            self.session = Session(self.source, limits=self.limits, settings=self.settings)
        run = self.session.run(json.dumps({"input": test.input, "output": output, "expected": test.output}))
        if run.status != "exited" or run.exit_code != 0 or not run.stdout.startswith("checked: "):
            raise SandboxError(f"sandbox: the problem's checker failed ({run.status}, {run.stderr.strip()[-200:]!r})")
        return run.stdout.strip() == "checked: True"

    def close(self) -> None:
        if self.session is not None:
            self.session.close()


def verdict(run: TestRun, test: Test, problem: Problem, limits: Limits, checker: Checker | None = None) -> str:
    if run.status == "timeout":
        return "timeout"
    if run.status == "output_limit":
        return "wrong"
    if run.status == "signaled":
        if run.signal in (signal.SIGXCPU, signal.SIGKILL) and run.cpu_s >= limits.cpu_s:
            return "timeout"
        return "runtime_error"
    if "MemoryError" in run.stderr[-400:]:
        return "memory"
    if run.exit_code != 0:
        return "runtime_error"
    if problem.kind == "stdin":
        if stdout_matches(run.stdout, test.output, problem.tolerance):
            return "passed"
        return "passed" if checker is not None and checker.accepts(test, run.stdout) else "wrong"
    try:
        result = json.loads(run.result or "", parse_constant=_reject_constant)
    except ValueError:
        return "runtime_error"  # nothing returned (it exited before the call ended)
    if not isinstance(result, dict) or "value" not in result:
        return "wrong"  # unencodable: not plain builtin data
    return "passed" if any(value_equal(result["value"], want, problem.tolerance)
                           for want in expected_values(test.output)) else "wrong"


def judge(program: str, problem: Problem, tests: list[Test] | None = None, stop_at_first_failure: bool = True,
          limits: Limits = Limits(), settings=None) -> Judgement:
    """Run `tests` (default: all of the problem's) of `program` in one sandbox."""
    return judge_programs([program], problem, tests, stop_at_first_failure, limits, settings)[0]


def judge_programs(programs: list[str], problem: Problem, tests: list[Test] | None = None,
                   stop_at_first_failure: bool = True, limits: Limits = Limits(), settings=None) -> list[Judgement]:
    """Several programs (a prompt's group) on the same tests, in turn in one sandbox: one start
    for all of them, a fresh process per test as ever (the tmpfs emptied between programs)."""
    tests = list(problem.tests if tests is None else tests)
    judgements = [Judgement() for _ in programs]
    started = time.monotonic()
    checker = Checker(problem.checker, limits, settings) if problem.checker and problem.kind == "stdin" else None
    try:
        with Session(programs[0], problem.kind, problem.func_name, limits, settings) as session:
            for index, (program, judgement) in enumerate(zip(programs, judgements)):
                begun = time.monotonic()
                for number, test in enumerate(tests):
                    switch = program if index and not number else None
                    run = session.run(test.input, switch)
                    judgement.verdicts.append(verdict(run, test, problem, limits, checker))
                    if stop_at_first_failure and judgement.verdicts[-1] != "passed":
                        break
                judgement.sandbox_s = time.monotonic() - begun
    except SandboxError as err:
        for judgement in judgements:
            if judgement.infrastructure_error is None and (not judgement.verdicts or judgement.sandbox_s == 0.0):
                judgement.infrastructure_error = str(err)
                judgement.verdicts.append("infrastructure")
    finally:
        if checker is not None:
            checker.close()
    judgements[0].sandbox_s += (time.monotonic() - started) - sum(j.sandbox_s for j in judgements)  # the start
    return judgements
