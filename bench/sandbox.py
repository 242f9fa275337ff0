"""The code sandbox's throughput through the whole path (gspo_mcore.rewards.code.score_group:
a sandbox per program, started in the background while the previous program runs, the harness,
a forked process per test, host-side judging), on trivial tests.

    python bench/sandbox.py [--responses 64] [--tests 10] [--smoke]

Prints per mode the tests per second: responses scored one call each with one and two workers
(threads), and groups of 8 (reward.batched: one call per group; the programs differ, so none is
judged once for several); where the time goes: a sandbox started cold (bubblewrap, the
interpreter, the harness's ready), a program's start on a spare started in the background, and
one test in a running sandbox. The last line is JSON with every figure. Not a test: the figures
depend on the machine and its load (`--smoke`: the smallest sizes, every path).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from gspo_mcore.rewards.code import score_group
from gspo_mcore.sandbox import Problem, Session, Test, check_sandbox

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
    print(json.dumps({key: round(value, 2) for key, value in line.items()}))


if __name__ == "__main__":
    main()
