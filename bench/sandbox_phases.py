"""Where one test's time goes in the harness (run by bench/sandbox.py on the harness's own
interpreter, `-I -S`, outside bubblewrap): gspo_mcore/sandbox/harness.py's run_test called in a
loop, timed at each phase by marks that the parent and the forked test process write into a
shared page; and a bare fork (a pipe, `_exit`, waitpid) of this interpreter, the floor of any
fork-per-test design. Prints one JSON line: medians in ms, CPU and minor page faults per test.

    python -I -S bench/sandbox_phases.py HARNESS_PATH [TESTS]
"""

import importlib.util
import json
import mmap
import os
import resource
import statistics
import struct
import sys
import time

PROGRAM = "a, b = map(int, input().split())\nprint(a + b)\n"
LIMITS = {"cpu_s": 4.0, "wall_s": 8.0, "memory_bytes": 1024**3, "output_bytes": 16 * 1024**2,
          "file_bytes": 16 * 1024**2, "open_files": 64, "processes": 32}
# (phase, from mark, to mark); marks 0-2, 6-8 by the harness, 3-5 by the test process
PHASES = (("fork in the harness", 0, 1), ("fork to the test process running", 0, 2),
          ("test set-up (session, fds, uid, rlimits, streams)", 2, 3), ("the program (compile, run)", 3, 4),
          ("the test's exit to the harness seeing it", 5, 6), ("kill, wait4, report built", 6, 7))
MARKS = 8
_page = mmap.mmap(-1, 8 * MARKS)  # MAP_SHARED: the forked test process's marks are the parent's to read


def _mark(slot, _now=time.monotonic, _pack=struct.pack_into):
    _pack("d", _page, 8 * slot, _now())


def _instrumented(harness):
    """The harness's functions wrapped to mark each phase (os.fork, os.wait4: this process's)."""
    fork, enter, finish, exchange_run = os.fork, harness._enter, harness._finish_like_python, harness._Exchange.run

    def marked_fork():
        _mark(0)
        pid = fork()
        _mark(2 if pid == 0 else 1)
        return pid

    def marked_enter(*args):
        enter(*args)
        _mark(3)

    def marked_finish():
        _mark(4)
        finish()

    def marked_exit(code, _exit=os._exit):
        _mark(5)
        _exit(code)

    def marked_run(self, deadline):
        status = exchange_run(self, deadline)
        _mark(6)
        return status

    os.fork, harness._enter, harness._finish_like_python, harness._Exchange.run = (
        marked_fork, marked_enter, marked_finish, marked_run)
    harness._child.__defaults__ = harness._child.__defaults__[:-1] + (marked_exit,)


def _usage():
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return (me.ru_utime + me.ru_stime, children.ru_utime + children.ru_stime, me.ru_minflt, children.ru_minflt)


def _per_test(before, after, tests):
    cpu_me, cpu_children, faults_me, faults_children = ((b - a) / tests for a, b in zip(before, after))
    return {"harness_cpu_ms": 1000 * cpu_me, "test_cpu_ms": 1000 * cpu_children,
            "harness_faults": faults_me, "test_faults": faults_children}


def bare_fork(tests):
    """fork, the child writes a byte on a pipe and _exits, the parent reads it and waits."""
    walls, before = [], _usage()
    for _ in range(tests):
        started = time.monotonic()
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(write, b"x")
            os._exit(0)
        os.close(write)
        os.read(read, 1)
        os.close(read)
        os.waitpid(pid, 0)
        walls.append(time.monotonic() - started)
    return {"wall_ms": 1000 * statistics.median(walls), **_per_test(before, _usage(), tests)}


def harness_phases(path, tests):
    spec = importlib.util.spec_from_file_location("harness", path)
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    _instrumented(harness)
    request = {"kind": "stdin", "program": PROGRAM, "limits": LIMITS, "pid_namespace": False, "uid": None}
    rows, walls, before = [], [], _usage()
    for _ in range(tests):
        started = time.monotonic()
        report = harness.run_test(request, "1 2\n")
        _mark(7)
        walls.append(time.monotonic() - started)
        assert report["stdout"] == b"3\n", report  # the bytes as read: the host decodes them
        marks = struct.unpack_from(f"{MARKS}d", _page)
        rows.append([marks[end] - marks[start] for _, start, end in PHASES])
    phases = {name: 1000 * statistics.median(row[i] for row in rows) for i, (name, _, _) in enumerate(PHASES)}
    return {"wall_ms": 1000 * statistics.median(walls), "phases_ms": phases, **_per_test(before, _usage(), tests)}


if __name__ == "__main__":
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    print(json.dumps({"bare_fork": bare_fork(count), "harness": harness_phases(sys.argv[1], count)}))
