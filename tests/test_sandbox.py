"""The sandbox against the attacks a policy finds under RL, and correct programs through it.

Each attack is first shown to beat a naive grader of the kind other frameworks ship (the program
run inside the grader's process and compared there, or run as a plain subprocess whose exit code
or output is taken as it comes), then shown to fail here. The CI machine runs as root: the
sandbox drops each program to its slot's own uid there as well."""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from gspo_mcore.sandbox import Limits, Problem, SandboxUnavailable, Session, Test, check_sandbox, judge
from gspo_mcore.sandbox import session as session_module

FAST = Limits(cpu_s=2, wall_s=3, memory_bytes=512 * 1024**2, processes=16)
ADD = Problem("stdin", (Test("1 2\n", "3\n"), Test("5 7\n", "12\n")))
SORT = Problem("functional", (Test("[[3, 1, 2]]", "[1, 2, 3]"), Test("[[2, 1]]", "[1, 2]")), func_name="sort")
SORT_HEADER = "class Solution:\n    def sort(self, a):\n"


def run_judge(program: str, problem: Problem = ADD, **kwargs):
    judgement = judge(textwrap.dedent(program), problem, limits=kwargs.pop("limits", FAST), **kwargs)
    if judgement.infrastructure_error:  # shown with a failing assertion (captured output)
        print("infrastructure error:", judgement.infrastructure_error)
    return judgement


# ---- naive graders (what the sandbox replaces)

def in_process_grader(program: str, problem: Problem) -> bool:
    """LiveCodeBench-style: exec the program here, compare `result == expected` here."""
    for test in problem.tests:
        expected_output = test.output  # noqa: F841 (a local of this frame, as in the graders copied around)
        namespace: dict = {"__name__": "__main__"}
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            try:
                exec(program, namespace)
                if problem.kind == "functional":
                    result = getattr(namespace["Solution"](), problem.func_name)(*json.loads(test.input))
            except SystemExit:
                pass
        if problem.kind == "functional":
            if not result == json.loads(test.output):
                return False
        elif out.getvalue().split() != test.output.split():
            return False
    return True


def exit_code_grader(program: str, stdin: str = "", **popen) -> bool:
    """SandboxFusion-assert-style: the test passes when the process exits 0."""
    return subprocess.run([sys.executable, "-c", program], input=stdin, text=True, capture_output=True,
                          timeout=20, **popen).returncode == 0


def subprocess_output(program: str, stdin: str = "", **popen) -> str:
    return subprocess.run([sys.executable, "-c", program], input=stdin, text=True, capture_output=True,
                          timeout=20, **popen).stdout


# ---- returned values that lie about themselves

def test_eq_always_true_fools_an_in_process_grader_not_the_sandbox():
    program = SORT_HEADER + "        class Yes:\n            def __eq__(self, other): return True\n        return Yes()\n"
    assert in_process_grader(program, SORT)
    judgement = run_judge(program, SORT)
    assert judgement.verdicts == ["wrong"] and not judgement.passed


@pytest.mark.parametrize("base", ["int", "str", "list"])
def test_builtin_subclasses_are_refused(base):
    program = SORT_HEADER + (f"        class Liar({base}):\n            def __eq__(self, other): return True\n"
                             f"            __hash__ = {base}.__hash__\n        return Liar()\n")
    assert in_process_grader(program, SORT)
    assert run_judge(program, SORT).verdicts == ["wrong"]


def test_expected_output_from_frames_and_heap_is_not_there():
    program = textwrap.dedent("""
        import sys, gc
        frame = sys._getframe()
        while frame is not None:
            if 'expected_output' in frame.f_locals:
                print(frame.f_locals['expected_output']); break
            frame = frame.f_back
        else:
            gc.unfreeze()  # the harness's objects, frozen before the fork, back in reach
            for obj in gc.get_objects():
                if isinstance(obj, dict) and 'output' in obj:
                    print(obj['output']); break
    """)
    assert in_process_grader(program, ADD)
    assert run_judge(program).verdicts == ["wrong"]


# ---- exit codes are not verdicts

@pytest.mark.parametrize("exit_call", ["raise SystemExit(0)", "import os; os._exit(0)",
                                       "import os, sys; os._exit = sys.exit = lambda *a: None; raise SystemExit(0)"])
def test_exit_zero_before_any_output_is_not_a_pass(exit_call):
    program = f"{exit_call}\nassert solve() == 3\n"
    assert exit_code_grader(program)
    assert run_judge(program).verdicts == ["wrong"]


# ---- looking for the tests

def test_tests_on_disk_in_fds_or_the_parents_proc_are_out_of_reach(tmp_path):
    tests_file = tmp_path / "tests.json"
    tests_file.write_text(json.dumps([[t.input, t.output] for t in ADD.tests]))
    program = textwrap.dedent(f"""
        import os, json, sys
        x = sum(map(int, sys.stdin.read().split()))
        found = []
        candidates = [{str(tests_file)!r}]
        for pid in ('self', str(os.getppid()), '1'):
            try:
                candidates += [f'/proc/{{pid}}/fd/{{fd}}' for fd in os.listdir(f'/proc/{{pid}}/fd')]
            except OSError:
                pass
        for path in candidates:
            try:
                if not os.path.isfile(path):  # a pipe would block
                    continue
                with open(path, errors="replace") as f:  # the parent's other fds: binary files too
                    text = f.read(1 << 20)
            except (OSError, ValueError):
                continue
            if '"3\\\\n"' in text:
                found.append(path)
        print(x if found else -1)
    """)
    with open(tests_file) as held:  # the naive grader holds its tests open, as graders do
        assert subprocess_output(program, "1 2\n", pass_fds=(held.fileno(),)).strip() == "3"
    assert run_judge(program).verdicts == ["wrong"]


# ---- resource attacks; the sandbox survives each and runs the next test

def _judge_then_correct(program: str) -> str:
    """The attack's verdict, after checking a correct program still runs in a fresh sandbox."""
    verdict = run_judge(program).verdicts[0]
    assert run_judge("print(sum(map(int, input().split())))").passed
    return verdict


def test_ignoring_signals_and_spinning_is_stopped(tmp_path):
    program = textwrap.dedent("""
        import signal
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGXCPU, signal.SIGALRM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        while True:
            pass
    """)
    naive = tmp_path / "naive.py"  # an in-process grader with an alarm as its time limit
    naive.write_text(f"import signal\nsignal.alarm(1)\nexec({program!r})\n")
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run([sys.executable, str(naive)], timeout=3)
    assert _judge_then_correct(program) == "timeout"


def test_raising_its_own_rlimits_fails():
    program = textwrap.dedent("""
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_CPU)
        try:
            resource.setrlimit(resource.RLIMIT_CPU, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        except (ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_CPU, (hard, hard))  # a soft limit rises to the hard one
        print(3 if resource.getrlimit(resource.RLIMIT_CPU)[0] == resource.RLIM_INFINITY else 'limited')
    """)
    import resource

    soft_only = lambda: resource.setrlimit(resource.RLIMIT_CPU, (5, resource.RLIM_INFINITY))  # noqa: E731
    assert subprocess_output(program, preexec_fn=soft_only).strip() == "3"  # a grader that set a soft limit
    assert run_judge(program).verdicts == ["wrong"]


FORK_COUNT = textwrap.dedent("""
    import os, sys
    made = 0
    for _ in range(60):
        try:
            pid = os.fork()
        except OSError:
            break
        if pid == 0:
            import time; time.sleep(2); os._exit(0)
        made += 1
    print(made)
""")


def test_fork_bomb_is_held_by_the_slot_uid():
    if os.geteuid() == 0:  # RLIMIT_NPROC alone, as root: not enforced
        limit = lambda: __import__("resource").setrlimit(__import__("resource").RLIMIT_NPROC, (16, 16))  # noqa: E731
        assert int(subprocess_output(FORK_COUNT, preexec_fn=limit)) == 60
    with Session(FORK_COUNT, limits=FAST) as session:
        assert int(session.run("").stdout) < FAST.processes
        assert int(session.run("").stdout) < FAST.processes  # the first test's children are gone


@pytest.mark.parametrize("bomb, verdicts", [
    ("x = bytearray(8 * 1024**3)", {"memory"}),
    ("import threading, time\nts = [threading.Thread(target=time.sleep, args=(5,)) for _ in range(1000)]\n"
     "[t.start() for t in ts]", {"runtime_error", "timeout"}),  # the started ones are waited for, as CPython does
    ("import os\nwhile True:\n    os.fork()", {"runtime_error", "timeout"}),
    ("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", {"output_limit"}),
], ids=["memory", "threads", "fork", "output_flood"])
def test_bombs_and_floods_end_in_a_verdict_and_the_sandbox_lives(bomb, verdicts):
    assert _judge_then_correct(bomb) in verdicts


def test_killing_its_parent_group_and_everything_it_may(tmp_path):
    program = textwrap.dedent("""
        import os, signal
        print(3, flush=True)
        for kill in (lambda: os.kill(os.getppid(), signal.SIGKILL), lambda: os.killpg(0, signal.SIGKILL),
                     lambda: os.kill(-1, signal.SIGKILL), lambda: os.kill(1, signal.SIGKILL)):
            try:
                kill()
            except OSError:
                pass
    """)
    # Unsandboxed it gets only its parent to kill: as root, kill(-1) would take the machine down.
    parent_only = "import os, signal\nprint(3, flush=True)\nos.kill(os.getppid(), signal.SIGKILL)\n"
    naive = tmp_path / "naive.py"  # a grader whose test process may signal it
    naive.write_text(f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {parent_only!r}])\n"
                     "print('graded')\n")
    assert "graded" not in subprocess.run([sys.executable, str(naive)], capture_output=True, text=True,
                                          start_new_session=True, timeout=20).stdout
    with Session(program, limits=FAST) as session:  # the harness outlives it: both tests report
        first, second = session.run("1 2\n"), session.run("5 7\n")
    assert first.stdout.strip() == "3" and second.stdout.strip() == "3"
    assert first.signal == 9  # killed by its own kill(-1): a runtime error, not a pass
    assert run_judge(program).verdicts == ["runtime_error"]


def test_writing_outside_its_tmpfs(tmp_path):
    marker = tmp_path / "written"
    os.chmod(tmp_path, 0o777)
    # Sandboxed, it also tries the host's hostname; the naive grader's run below (root, no
    # namespace) tries the marker only: it would rename the machine under the suite's feet.
    program = _writer(marker, ('/usr/x', '/sandbox/harness.py', '/proc/sys/kernel/hostname', '/x'))
    assert run_judge(program, Problem("stdin", (Test("", "[]"),))).passed
    assert not marker.exists()
    subprocess_output(_writer(marker, ()))
    assert marker.exists()  # a plain subprocess writes where the grader's user can


def _writer(marker, others) -> str:
    return textwrap.dedent(f"""
        import os
        wrote = []
        for path in ({str(marker)!r}, *{others!r}):
            try:
                with open(path, 'a') as f:
                    f.write('x')
                wrote.append(path)
            except OSError:
                pass
        with open('/tmp/scratch', 'w') as f:  # its own tmpfs: allowed
            f.write('ok')
        print(wrote)
    """)


def test_connecting_to_a_host_port():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    accepted = []
    threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
    program = textwrap.dedent(f"""
        import socket
        try:
            socket.create_connection(('127.0.0.1', {port}), timeout=1); print('connected')
        except OSError as err:
            print('refused')
    """)
    assert subprocess_output(program).strip() == "connected"
    with Session(program, limits=FAST) as session:
        assert session.run("").stdout.strip() == "refused"
    server.close()


def test_closing_its_own_stdout(tmp_path):
    program = "import os\nos.close(1)\nos.close(2)\n"
    naive = tmp_path / "naive.py"  # an in-process grader that reports on the stdout it shares
    naive.write_text(f"exec({program!r})\nprint('verdict: wrong')\n")
    assert "verdict" not in subprocess.run([sys.executable, str(naive)], capture_output=True, text=True).stdout
    assert _judge_then_correct(program) == "wrong"


# ---- correct programs pass

@pytest.mark.parametrize("program", [
    "import sys\na, b = map(int, sys.stdin.buffer.read().split())\nsys.stdout.buffer.write(f'{a + b}\\n'.encode())",
    "a, b = map(int, input().split())\nprint(a + b, '   ')\nprint()\nprint('  ')",
    "x = bytearray(100 * 1024**2)\na, b = map(int, input().split())\nprint(a + b)",
    "def depth(n):\n    return 0 if n == 0 else 1 + depth(n - 1)\nassert depth(5000) == 5000\n"
    "print(sum(map(int, input().split())))",
    "import sys\nprint(sum(map(int, input().split())))\nsys.exit(0)",
], ids=["stdin_buffer", "trailing_whitespace", "100MB", "recursion_5000", "sys_exit_0"])
def test_correct_stdin_programs_pass(program):
    judgement = judge(program, ADD, limits=Limits())
    assert judgement.passed, judgement


def test_the_harness_heap_is_frozen_before_each_fork():
    """Old code: a collection in the test process walked the harness's objects, copying its heap
    page by page (bench/sandbox.py: ~230 page faults, 1-2.5 ms of CPU a test)."""
    program = "import gc\nprint(gc.get_freeze_count() > 1000)"
    assert judge(program, Problem("stdin", (Test("", "True\n"),) * 2), limits=FAST).passed


def test_correct_functional_programs_pass():
    program = "from typing import List\nclass Solution:\n    def sort(self, a: List[int]) -> List[int]:\n" \
              "        return sorted(a)\n"
    assert judge(program, SORT).passed
    untyped = "class Solution:\n    def sort(self, a: List[int]) -> List[int]:\n        return tuple(sorted(a))\n"
    assert judge(untyped, SORT).passed  # LiveCodeBench's names without the import; a tuple as a list


def test_a_spare_killed_after_it_said_ready_is_replaced():
    """A spare sandbox killed from outside while it waits (seen in CI: a stale process-group id
    signalled) is replaced by one started now, not judged an infrastructure error."""
    import select
    import signal
    import time

    assert run_judge("print(sum(map(int, input().split())))").passed  # a spare now waits for the next program
    launcher = session_module._launcher()
    with launcher.lock:
        spares = [future.result(timeout=15) for future in launcher.spares.values()]
    assert spares
    for spare in spares:
        waiting = select.poll()
        waiting.register(spare.process.stdout.fileno(), select.POLLIN)
        assert waiting.poll(15_000)  # it said ready (unread in its pipe); then it dies
        os.killpg(spare.process.pid, signal.SIGKILL)  # bwrap; the harness in its own session follows it
        spare.process.wait()
        procs = spare.slot.cgroup.directories[0] / "cgroup.procs"
        deadline = time.monotonic() + 10
        while procs.read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.01)
    judgement = run_judge("print(sum(map(int, input().split())))")
    assert judgement.passed, judgement


# ---- where the sandbox cannot run

def test_no_bubblewrap_is_a_one_line_refusal(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(session_module, "_checked", set())
    with pytest.raises(SandboxUnavailable) as refused:
        check_sandbox()
    message = str(refused.value)
    assert "\n" not in message and "apt-get install bubblewrap" in message and "GSPO_SANDBOX_UNSAFE" in message


def test_a_bwrap_that_cannot_make_namespaces_is_a_one_line_refusal(monkeypatch, tmp_path):
    fake = tmp_path / "bwrap"  # what bwrap says where user namespaces are off
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to creating new namespace, likely because the kernel "
                    "does not allow non-privileged user namespaces.' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(session_module, "_checked", set())
    with pytest.raises(SandboxUnavailable) as refused:
        check_sandbox()
    message = str(refused.value)
    assert "\n" not in message and "No permissions to creating new namespace" in message
    assert "unprivileged_userns_clone" in message and "GSPO_SANDBOX_UNSAFE_NO_ISOLATION=1" in message


def test_the_unsafe_mode_is_explicit_and_warns(monkeypatch, capsys):
    from gspo_mcore.sandbox import launch

    monkeypatch.setenv("GSPO_SANDBOX_UNSAFE_NO_ISOLATION", "1")
    monkeypatch.setattr(launch, "_warned", False)
    judgement = run_judge("print(sum(map(int, input().split())))")
    assert judgement.passed
    assert "WARNING: sandbox: GSPO_SANDBOX_UNSAFE_NO_ISOLATION=1: untrusted programs run with rlimits only" in \
        capsys.readouterr().err


NON_ROOT = textwrap.dedent("""
    import os
    from gspo_mcore.sandbox import Session, SandboxError, check_sandbox
    check_sandbox()
    program = ("import os\\ntry:\\n    os.listdir(f'/proc/{os.getppid()}/fd'); print('read')\\n"
               "except OSError:\\n    print('refused')\\n")
    with Session(program) as session:
        print(os.getuid(), session.run('').stdout.strip())
    opened = ("import os\\nmade = []\\nfor path, flags in (('/x', os.O_CREAT | os.O_WRONLY), ('/dev/x', os.O_CREAT | "
              "os.O_WRONLY), ('/dev/ptmx', os.O_RDWR)):\\n    try:\\n        os.open(path, flags, 0o600)\\n"
              "        made.append(path)\\n    except OSError:\\n        pass\\nprint(''.join(made) or 'none')\\n")
    with Session(opened) as session:  # the root and /dev are the user's own tmpfs: read-only; no devpts
        print(session.run('').stdout.strip())
    with Session("import os, signal\\nos.kill(os.getppid(), signal.SIGKILL)") as session:
        try:
            session.run('')
        except SandboxError:
            print('infrastructure')
""")


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/setpriv") or not os.path.exists(
    f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"), reason="needs root to become nobody")
def test_started_by_a_user_that_is_not_root():
    """bwrap makes a user namespace; the tests keep the user's uid there: the harness's fds are
    still closed to them, `/` and `/dev` are read-only and hold no PTY multiplexer (old code:
    all three opened), and a test that kills the harness is an infrastructure error."""
    python = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"
    done = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", python, "-c", NON_ROOT],
                          env={"PYTHONPATH": str(Path(__file__).resolve().parents[1]), "HOME": "/tmp"},
                          capture_output=True, text=True, timeout=60, cwd="/tmp")
    assert done.stdout.split() == ["65534", "refused", "none", "infrastructure"], done.stderr[-2000:]


def test_a_fork_bomb_leaves_nothing_to_the_next_program_of_its_group():
    """One sandbox judges a group's programs in turn: the bomb's processes are killed (and waited
    for until reaped) before the next program runs, whose forks then succeed."""
    from gspo_mcore.sandbox.judge import judge_programs

    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    forks = "import os\npid = os.fork()\nif pid == 0:\n    os._exit(0)\nos.waitpid(pid, 0)\n" \
            "print(sum(map(int, input().split())))"
    first, second = judge_programs([bomb, forks], ADD, limits=FAST)
    assert first.verdicts[0] in {"timeout", "runtime_error"} and second.passed, (first, second)
