"""The code sandbox's throughput through the whole path (gspo_mcore.rewards.code.score_group:
a sandbox per program, started in the background while the previous program runs, the harness,
a forked process per test, host-side judging), on trivial tests.

    python bench/sandbox.py [--responses 64] [--tests 10] [--smoke]

Prints per mode the tests per second: responses scored one call each with one and two workers
(threads), and groups of 8 (reward.batched: one call per group; the programs differ, so none is
judged once for several); where the time goes: a sandbox started cold (bubblewrap, the
interpreter, the harness's ready), a program's start on a spare started in the background, and
one test in a running sandbox; then where one test's time goes, a line a phase in ms per test:
the whole path split into the harness's run_test (its report's wall_s) and the rest (the
framed messages, the pipes, the host's read and verdict), the CPU and minor page faults a test
costs on the host and in the sandbox (bwrap, the harness, the tests it reaped: /proc), the
harness's phases (bench/sandbox_phases.py: run_test in a loop on the harness's interpreter,
outside bubblewrap) and a bare fork of that interpreter, the floor of a fork per test. The last
line is JSON with the throughput figures. Not a test: the figures depend on the machine and its
load (`--smoke`: the smallest sizes, every path).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gspo_mcore.rewards.code import score_group
from gspo_mcore.sandbox import Problem, Session, Test, check_sandbox
from gspo_mcore.sandbox.judge import verdict
from gspo_mcore.sandbox.launch import HARNESS, interpreter
from gspo_mcore.sandbox.session import Limits

RESPONSE = "```python\n# response {}\na, b = map(int, input().split())\nprint(a + b)\n```"  # distinct texts


def problem(tests: int) -> Problem:
    return Problem("stdin", tuple(Test(f"{i} {i}\n", f"{2 * i}\n") for i in range(tests)))


def tests_per_s(responses: int, tests: int, workers: int, group: int) -> float:
    """Every response's every test passes (checked); `group` responses share a sandbox."""
    task = problem(tests)
    groups = [[RESPONSE.format(g * group + i) for i in range(group)] for g in range(responses // group)]
    started = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        scored = [s for result in pool.map(lambda g: score_group(g, task, every_test=True), groups) for s in result]
    seconds = time.perf_counter() - started
    assert all(s.passed for s in scored) and len(scored) == len(groups) * group
    return len(scored) * tests / seconds


def overhead_ms(repeats: int) -> tuple[float, float, float]:
    """(a cold start: bubblewrap, interpreter, ready; a program's start on a ready spare, what a
    response pays; one test in a running sandbox), medians in ms."""
    cold, warm, one = [], [], []
    program = "print(sum(map(int, input().split())))"
    for _ in range(repeats):
        started = time.perf_counter()
        with Session(program, spare=False) as session:
            cold.append(time.perf_counter() - started)
            session.run("1 2\n")
        with Session(program):  # a spare: started while the last one was running
            pass
        time.sleep(0.1)  # the next spare's start, off the clock
        started = time.perf_counter()
        with Session(program) as session:
            warm.append(time.perf_counter() - started)
            session.run("1 2\n")
            started = time.perf_counter()
            session.run("1 2\n")
            one.append(time.perf_counter() - started)
    return 1000 * statistics.median(cold), 1000 * statistics.median(warm), 1000 * statistics.median(one)


def _sandbox_usage(session: Session) -> tuple[float, int]:
    """(CPU seconds, minor page faults) of a sandbox's processes so far: bwrap, the harness, and
    the test processes they reaped (/proc's cutime, cstime, cminflt)."""
    pids, cpu, faults = [session.sandbox.process.pid], 0, 0
    while pids:
        pid = pids.pop()
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                pids += map(int, Path(f"/proc/{pid}/task/{task}/children").read_text().split())
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # a test process that ended meanwhile: its parent's counts have it
            continue
        faults += int(fields[7]) + int(fields[8])
        cpu += sum(int(value) for value in fields[11:15])
    return cpu / os.sysconf("SC_CLK_TCK"), faults


def breakdown(tests: int) -> dict[str, float]:
    """One program's `tests` trivial tests through Session.runs and the judge's verdict, per test."""
    task = problem(tests)
    with Session("a, b = map(int, input().split())\nprint(a + b)") as session:
        session.run("1 2\n")
        (cpu_before, faults_before), host_before = _sandbox_usage(session), time.thread_time()
        started, harness_s, judging_s = time.perf_counter(), 0.0, 0.0
        for test, run in zip(task.tests, session.runs([test.input for test in task.tests])):
            judged = time.perf_counter()
            assert verdict(run, test, task, Limits()) == "passed"
            judging_s += time.perf_counter() - judged
            harness_s += run.wall_s
        wall_s, host_s = time.perf_counter() - started, time.thread_time() - host_before
        cpu_after, faults_after = _sandbox_usage(session)
    return {"wall": 1000 * wall_s / tests, "harness run_test": 1000 * harness_s / tests,
            "rest": 1000 * (wall_s - harness_s) / tests, "host verdict": 1000 * judging_s / tests,
            "host CPU": 1000 * host_s / tests, "sandbox CPU": 1000 * (cpu_after - cpu_before) / tests,
            "sandbox faults": (faults_after - faults_before) / tests}


def harness_phases(tests: int) -> dict:
    """bench/sandbox_phases.py's figures, on the harness's own interpreter."""
    script = Path(__file__).with_name("sandbox_phases.py")
    out = subprocess.run([interpreter()[0], "-I", "-S", str(script), str(HARNESS), str(tests)], check=True,
                         capture_output=True, text=True, timeout=600).stdout
    return json.loads(out.splitlines()[-1])


def print_breakdown(tests: int) -> None:
    print(f"where a test's time goes (ms per test; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs):")
    whole = breakdown(tests)
    print(f"  the whole path (Session.runs, verdict): {whole['wall']:.2f}, of which the harness's run_test "
          f"{whole['harness run_test']:.2f}, the rest (messages, pipes, host) {whole['rest']:.2f}")
    print(f"  CPU: host {whole['host CPU']:.2f} (verdict {whole['host verdict']:.3f}), sandbox "
          f"{whole['sandbox CPU']:.2f} ({whole['sandbox faults']:.0f} minor page faults)")
    phases = harness_phases(tests)
    harness, bare = phases["harness"], phases["bare_fork"]
    print(f"  the harness's run_test in a loop, outside bubblewrap: {harness['wall_ms']:.2f}")
    for name, ms in harness["phases_ms"].items():
        print(f"    {name}: {ms:.2f}")
    for label, figures in (("run_test", harness), ("a bare fork, pipe, _exit, waitpid", bare)):
        print(f"  CPU of {label}: {figures['harness_cpu_ms'] + figures['test_cpu_ms']:.2f} (parent "
              f"{figures['harness_cpu_ms']:.2f}, child {figures['test_cpu_ms']:.2f}; page faults "
              f"{figures['harness_faults']:.0f} + {figures['test_faults']:.0f}), wall {figures['wall_ms']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--responses", type=int, default=64)
    parser.add_argument("--tests", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="8 responses of 2 tests")
    args = parser.parse_args()
    responses, tests = (8, 2) if args.smoke else (args.responses, args.tests)
    check_sandbox()
    cold_ms, spare_ms, test_ms = overhead_ms(3 if args.smoke else 20)
    line = {"tests_per_s": tests_per_s(responses, tests, 1, 1),
            "tests_per_s_2_workers": tests_per_s(responses, tests, 2, 1),
            "tests_per_s_group_of_8": tests_per_s(responses, tests, 1, 8),
            "response_overhead_ms": spare_ms, "cold_start_ms": cold_ms, "test_ms": test_ms}
    for key, value in line.items():
        print(f"{key:>24}: {value:.1f}")
    print_breakdown(20 if args.smoke else 400)
    print(json.dumps({key: round(value, 2) for key, value in line.items()}))


if __name__ == "__main__":
    main()
