"""The judge against a policy that games it rather than the sandbox (issue 46): programs of one
group passing state to each other, output that crashes the host's comparison, memory past every
per-process limit, a candidate that makes its group-mates' verdicts infrastructure errors; and
what a contest solver writes judged right (the thread idiom, long output, exact CPU limits).
Each attack fails and the honest program beside it still passes; each first failed on the code
it fixes (noted per test)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from gspo_mcore.sandbox import Limits, Problem, SandboxSettings, SandboxUnavailable, Session, Test, judge
from gspo_mcore.sandbox import cgroup, launch
from gspo_mcore.sandbox.judge import expected_values, judge_programs, stdout_matches, value_equal

FAST = Limits(cpu_s=2, wall_s=3, memory_bytes=512 * 1024**2, processes=16)
ADD = Problem("stdin", (Test("1 2\n", "3\n"),))
HONEST = "print(sum(map(int, input().split())))"


# ---- A. programs of one group see nothing of each other

PROBE = textwrap.dedent("""
    # program {index}
    import gc, os, sys
    others = ['# program ' + str(i) for i in range(3) if i != {index}]
    gc.unfreeze()  # the harness's objects, frozen before the fork, back in reach
    texts, frame = [x for x in gc.get_objects() if type(x) is str], sys._getframe()
    while frame is not None:  # the harness's frames: the request it holds
        texts += [repr(v) for k, v in frame.f_locals.items() if k not in ('others', 'texts') and v is not globals()]
        frame = frame.f_back
    source_seen = any(o in text and text not in others for o in others for text in texts)
    print(sorted(os.listdir('/tmp')), os.getpid(), source_seen)
    for name in ('/tmp/left-by-a-group-mate', '/tmp/dir/inner'):
        os.makedirs(os.path.dirname(name), exist_ok=True)
        open(name, 'w').close()
    os.chmod('/tmp/dir', 0)  # a saboteur's unreadable directory: the old harness's cleaning failed on it
""")


def test_programs_of_a_group_share_no_files_pids_or_sources():
    """Old code: the group shared one sandbox; the second program's PID was higher (the counter
    ran on), and the unreadable directory made the harness's cleaning fail: an infrastructure
    error for every later program. Now each one's view is what a lone program sees."""
    with Session(PROBE.format(index=9), limits=FAST) as alone:
        fresh = alone.run("").stdout
    assert fresh.startswith("[] ") and fresh.rstrip().endswith("False"), fresh
    probe = Problem("stdin", (Test("", fresh),))
    judgements = judge_programs([PROBE.format(index=i) for i in range(3)], probe, limits=FAST)
    assert [j.verdicts for j in judgements] == [["passed"]] * 3, judgements


def test_identical_programs_are_judged_once():
    judgements = judge_programs([HONEST, "print(0)", HONEST], ADD, limits=FAST)
    assert [j.verdicts for j in judgements] == [["passed"], ["wrong"], ["passed"]]
    assert judgements[2].same_as == 0 and judgements[2].sandbox_s == 0.0


# ---- B. output that cannot be compared is that test's `wrong`, and no one else's

SORT = Problem("functional", (Test("[[3, 1, 2]]", "1.5"),), func_name="sort", tolerance=1e-6)  # a float answer
SORT_CORRECT = "class Solution:\n    def sort(self, a):\n        return 1.5000001\n"  # within 1e-6


@pytest.mark.parametrize("body", [
    "import os\n        os.write(3, b'[' * 200000)\n        os._exit(0)",  # RecursionError in json.loads
    "return 10**400",  # OverflowError in math.isclose against a float
])
def test_a_result_the_host_cannot_compare_is_wrong_and_the_group_is_judged(body):
    """Old code: the exception left judge_programs: the whole group scored as an error."""
    attack = f"class Solution:\n    def sort(self, a):\n        {body}\n"
    attack_judgement, honest = judge_programs([attack, SORT_CORRECT], SORT, limits=FAST)
    assert attack_judgement.verdicts == ["wrong"] and honest.verdicts == ["passed"], \
        (attack_judgement.infrastructure_error, honest.infrastructure_error)


def test_numbers_past_decimals_range_are_wrong():
    """Old code: decimal.Overflow from `a - b`; math.isclose's OverflowError."""
    assert not stdout_matches("1e9999999\n", "0.5\n", tolerance=1e-6)
    assert not value_equal(10**400, 1.5, tolerance=1e-6)
    close = Problem("stdin", (Test("", "0.5\n"),), tolerance=1e-6)
    attack, honest = judge_programs(["print('1e9999999')", "print(0.5000001)"], close, limits=FAST)
    assert attack.verdicts == ["wrong"] and honest.verdicts == ["passed"]


# ---- C. the sandbox's memory and kernel objects bounded

SYSCALLS = textwrap.dedent("""
    import ctypes, os
    libc = ctypes.CDLL(None, use_errno=True)
    shm = libc.shmget(0, 1 << 20, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
    print('shmget', 'denied' if shm < 0 and ctypes.get_errno() == 1 else 'made')
    if shm >= 0:
        libc.shmctl(shm, 0, None)  # IPC_RMID: a segment outlives its process
    open('/tmp/f', 'w').close()
    try:
        os.setxattr('/tmp/f', 'user.x', b'1' * 1000)
        print('setxattr made')
    except OSError as err:
        print('setxattr', 'denied' if err.errno == 1 else err.errno)
    fd = os.open('/tmp', os.O_RDONLY)
    print('syncfs', 'denied' if libc.syncfs(fd) < 0 and ctypes.get_errno() == 1 else 'ran')
    mq = ctypes.CDLL('librt.so.1', use_errno=True).mq_open(b'/q', 0o102, 0o600, None)  # O_RDWR | O_CREAT
    print('mq_open', 'denied' if mq < 0 and ctypes.get_errno() == 1 else 'made')
""")


def test_sysv_ipc_mqueues_xattrs_and_syncfs_are_denied():
    """Old code: a shared memory segment (not counted by RLIMIT_AS, outliving the test) and an
    xattr were made."""
    host = subprocess.run([sys.executable, "-c", SYSCALLS], capture_output=True, text=True, timeout=30).stdout
    assert "shmget made" in host  # unsandboxed, the segment is made (and removed again)
    with Session(SYSCALLS, limits=FAST) as session:
        run = session.run("")
    assert run.stdout.split("\n")[:4] == ["shmget denied", "setxattr denied", "syncfs denied", "mq_open denied"], run
    assert judge(HONEST, ADD, limits=FAST).passed


# Each child says `held` only once every child has had its turn to allocate (the barrier: the
# parent's byte, 1 s after the forks): the count is of blocks resident at once. Printed as each
# allocated, a child the cgroup killed later was counted too (4 seen, once forks got faster).
HOARD = textwrap.dedent("""
    import os, time
    r, w = os.pipe()
    for _ in range(6):
        if os.fork() == 0:
            os.close(w)
            block = b'x' * (100 * 1024**2)  # touched: resident, within each process's RLIMIT_AS
            os.read(r, 1)
            print('held', flush=True)
            time.sleep(0.5)
            os._exit(0)
    time.sleep(1.0)
    os.write(w, b'x' * 6)
    time.sleep(1.0)
""")


@pytest.mark.skipif(os.geteuid() != 0 or cgroup.unavailable() is not None, reason="needs root and cgroups")
def test_the_whole_sandbox_has_one_memory_limit():
    """Six processes of 100 MB each under a 128 MiB per-process limit: 600 MB past a sandbox
    bounded at ~300 MiB. Old code: all six held their memory (RLIMIT_AS is per process)."""
    limits = Limits(cpu_s=4, wall_s=6, memory_bytes=128 * 1024**2, processes=16, output_bytes=1024**2)
    with Session(HOARD, limits=limits) as session:
        run = session.run("")
    assert run.stdout.count("held") <= 3, run
    # the test process itself the largest when the sandbox is full: killed by the cgroup, `memory`
    largest = textwrap.dedent("""
        import os, time
        for _ in range(3):
            if os.fork() == 0:
                block = b'x' * (60 * 1024**2)
                time.sleep(2)
                os._exit(0)
        time.sleep(0.5)
        blocks = [b'x' * (10 * 1024**2) for _ in range(11)]
        print(3)
    """)
    assert judge(largest, ADD, limits=limits).verdicts == ["memory"]


@pytest.mark.skipif(os.geteuid() != 0 or cgroup.unavailable() is not None, reason="needs root and cgroups")
def test_a_cgroup_parent_another_process_removed_is_made_again(monkeypatch):
    """The slots' parent cgroups are shared by every process of the host's cgroup (pytest's
    workers, the reward workers); one's exit removes them when empty (remove_parents). Old code:
    the next sandbox of the others was an infrastructure error ("No such file or directory:
    .../gspo-sandbox/slot-0-...": seen in this suite while other test processes ran)."""
    found = cgroup.layout()
    gone = tuple(parent.parent / f"gspo-sandbox-gone-{os.getpid()}" for parent in found.parents)
    monkeypatch.setattr(cgroup, "_layout", cgroup._Layout(found.version, gone))
    slot = cgroup.SlotCgroup.create(0)
    try:
        assert all(directory.parent in gone and directory.is_dir() for directory in slot.directories)
    finally:
        slot.remove()
        cgroup.remove_parents()
    assert not any(parent.exists() for parent in gone)


# ---- D. a candidate's failure is its own `wrong`

DIVISOR = Problem("stdin", (Test("12\n", "2\n"),), checker="def check(input, output, expected):\n"
                  "    n, d = int(input), int(output)\n    return 1 < d < n and n % d == 0\n")


def test_a_checker_that_cannot_read_a_candidates_output_marks_that_candidate_wrong():
    """Old code: the checker's ValueError on `abc` was an infrastructure error, and every later
    program of the group was one too."""
    unreadable, valid, invalid = judge_programs(["print('abc')", "print(3)", "print(5)"], DIVISOR, limits=FAST)
    assert (unreadable.verdicts, valid.verdicts, invalid.verdicts) == (["wrong"], ["passed"], ["wrong"])
    assert unreadable.infrastructure_error is None
    broken = Problem("stdin", DIVISOR.tests, checker="def check(i, o, e):\n    raise ValueError('bug')\n")
    assert judge("print(3)", broken, limits=FAST).infrastructure_error  # fails on the expected output too


# ---- E. slots, the slot directory, numbers

def test_out_of_slots_is_an_infrastructure_error(monkeypatch, tmp_path):
    """Old code: an EngineError that was not a SandboxError: it left the judge."""
    slots = tmp_path / "slots"
    monkeypatch.setattr(launch, "SLOT_DIR", slots)
    one = SandboxSettings(slots=1)
    with Session(HONEST, limits=FAST, settings=one):  # holds the one slot; its spare finds none
        judgement = judge(HONEST, ADD, limits=FAST, settings=one)
    assert judgement.verdicts == ["infrastructure"] and "all 1 slots are in use" in judgement.infrastructure_error


@pytest.mark.skipif(os.geteuid() != 0, reason="slots are root's")
def test_the_slot_directory_must_be_a_private_directory(monkeypatch, tmp_path):
    """Old code: a symlink planted in /tmp was followed (lock files made where it pointed)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "link").symlink_to(elsewhere)
    monkeypatch.setattr(launch, "SLOT_DIR", tmp_path / "link")
    with pytest.raises(SandboxUnavailable, match="not a directory of uid 0 with mode 0700"):
        launch.Slot(SandboxSettings())
    assert not list(elsewhere.iterdir())


def test_numbers_compare_as_ascii_tokens_except_on_livecodebench_rows():
    """Old code: Decimal's reading everywhere: `007`, full-width digits and `1_000` matched."""
    for got, want in (("007", "7"), ("\uff17", "7"), ("1_000", "1000"), ("+5", "5")):
        assert not stdout_matches(got, want), got
        assert stdout_matches(got, want, lcb_numbers=True), got  # LiveCodeBench's grader: Decimal(token)
    assert stdout_matches("7.0", "7") and stdout_matches("-0.50", "-0.5")
    assert expected_values("[5]") == [[5]] and expected_values("[5]", unwrap=True) == [[5], 5]
    lcb, other = Problem("stdin", (Test("", "7\n"),), origin="livecodebench"), Problem("stdin", (Test("", "7\n"),))
    assert judge("print('007')", lcb, limits=FAST).passed and not judge("print('007')", other, limits=FAST).passed


# ---- 2, 3, 4: what a contest solver writes

THREADED = textwrap.dedent("""
    import sys, threading, time
    def main():
        time.sleep(0.2)
        print(sum(map(int, sys.stdin.readline().split())))
    threading.stack_size(64 * 1024**2)
    threading.Thread(target=main).start()
""")
AT_EXIT = "import atexit\na, b = map(int, input().split())\natexit.register(print, a + b)\n"


def test_the_thread_idiom_and_atexit_are_judged_as_cpython_runs_them():
    """Old code: the harness left with os._exit when the module body returned: nothing printed."""
    judgements = judge_programs([THREADED, AT_EXIT, "import threading\nthreading.Thread(target=print).start()"],
                                ADD, limits=FAST)
    assert [j.verdicts for j in judgements] == [["passed"], ["passed"], ["wrong"]]


def test_long_output_passes_and_too_long_is_its_own_verdict():
    """Old code: the cap was 1 MiB, fixed, and `wrong`."""
    from gspo_mcore.rewards.code import limits_for
    from gspo_mcore.rewards.code_config import CodeRewardConfig

    numbers = Problem("stdin", (Test("", "\n".join(map(str, range(200000))) + "\n"),))  # ~1.3 MB
    program = "print('\\n'.join(map(str, range(200000))))"
    assert judge(program, numbers, limits=limits_for(numbers, CodeRewardConfig())).passed
    small = limits_for(numbers, CodeRewardConfig(output_mb=1))
    assert small.output_bytes == 1024**2 and judge(program, numbers, limits=small).verdicts == ["output_limit"]


def test_the_cpu_limit_is_the_measured_cpu_time():
    """Old code: RLIMIT_CPU was the limit + 1 s and nothing compared after: 1.4 s passed 1 s."""
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < {}:\n    pass\n" + HONEST
    limits = Limits(cpu_s=1.0, wall_s=10, memory_bytes=512 * 1024**2)  # wall: room for a loaded machine
    over, under = judge_programs([spin.format(1.4), spin.format(0.2)], ADD, limits=limits)
    assert over.verdicts == ["timeout"] and under.verdicts == ["passed"]


def test_a_rows_format_decides_its_number_rule_and_prepare_codes_answer_keeps_it():
    import json

    from gspo_mcore.common.errors import InputError
    from gspo_mcore.rewards.code import answer_from_problem, problem_from_answer, problem_from_record

    cases = json.dumps([{"input": "", "output": "7\n", "testtype": "stdin"}])
    lcb = problem_from_record({"public_test_cases": cases}, "lcb:1")
    assert lcb.origin == "livecodebench" and problem_from_answer(answer_from_problem(lcb)) == lcb
    taco = problem_from_record({"input_output": {"inputs": [[1]], "outputs": [[5]], "fn_name": "f"}}, "taco:1")
    contests = problem_from_record({"public_tests": {"input": ["1"], "output": ["1"]}}, "cc:1")
    assert (taco.origin, contests.origin) == ("taco", "codecontests")
    forged = json.loads(answer_from_problem(lcb)) | {"origin": "mine"}
    with pytest.raises(InputError, match="^a:1: field 'answer': origin 'mine' is not one of"):
        problem_from_answer(json.dumps(forged), "a:1")


# ---- round 3, A: a group-mate's verdict read from time

AGE_READER = textwrap.dedent("""
    import os, time
    ticks = os.sysconf('SC_CLK_TCK')
    uptime = float(open('/proc/uptime').read().split()[0])
    # the oldest of what the sandbox made before this test: its processes, its /tmp
    started = min(int(open(f'/proc/{p}/stat').read().rsplit(')', 1)[1].split()[19]) / ticks
                  for p in os.listdir('/proc') if p.isdigit() and os.path.exists(f'/proc/{p}/stat'))
    process_age = uptime - started
    tmp_age = time.time() - min(os.stat('/tmp').st_ctime, os.stat('/dev').st_ctime)
    print('young' if max(process_age, tmp_age) < 0.4 else 'old')
""")
SLOW_PASSING = "import time\ntime.sleep(0.35)\nprint(sum(map(int, input().split())))"


def test_no_program_reads_a_group_mates_judging_time_from_its_sandbox_age():
    """A group of a program that passes three tests slowly (~1 s in its sandbox) and two that
    only read their own sandbox's age (its processes' start times, /tmp's and /dev's times):
    they are judged as young sandboxes, whatever came before (old code: the second program's spare
    had been started when the first began, and read `old`)."""
    problem = Problem("stdin", tuple(Test(f"{i} 1\n", "young\n") for i in range(3)))
    slow = SLOW_PASSING.replace("print(sum(map(int, input().split())))", "input()\nprint('young')")
    judgements = judge_programs([slow, AGE_READER, AGE_READER + "# another"], problem, limits=FAST)
    assert judgements[0].passed and judgements[0].sandbox_s > 1.0
    assert judgements[1].passed and judgements[2].passed, judgements


# ---- round 3, B: a wrong program's own verdict made an infrastructure error

KERNEL_MEMORY_THEN_INVALID_UTF8 = textwrap.dedent(r"""
    import os, sys
    with open('/tmp/fill', 'wb') as f:  # the tmpfs nearly full: its pages are the cgroup's
        try:
            for _ in range(64):
                f.write(b'x' * (1 << 20))
        except OSError:
            pass
    os.mkdir('/tmp/d')
    try:  # inodes and dentries: charged to the cgroup, not to the tmpfs's size
        for n in range({files}):
            open(f'/tmp/d/{{n:0200d}}', 'w').close()
    except BaseException:
        pass
    sys.stdout.buffer.write(b'\xff' * (16 * 1024 * 1024 - 1))  # invalid UTF-8 at the output cap
""")


@pytest.mark.parametrize("files", [60_000, 150_000])
def test_filling_the_sandboxs_kernel_memory_then_printing_invalid_utf8_is_the_programs_verdict(files):
    """The harness hands the host the output's bytes (decoding them in the sandbox took ~9x their
    size of its cgroup), and a harness the cgroup killed for what the program filled it with is
    the program's `memory`, not an infrastructure error (old code: `infrastructure` at 60k files,
    masked under reward.code.infrastructure_errors: mask). The honest program after it passes."""
    limits = Limits(cpu_s=8, wall_s=20, memory_bytes=32 * 1024**2, processes=16)
    attack, honest = judge_programs([KERNEL_MEMORY_THEN_INVALID_UTF8.format(files=files), HONEST], ADD, limits=limits)
    assert attack.infrastructure_error is None and attack.verdicts in (["wrong"], ["memory"]), attack
    assert honest.passed


def test_a_harness_killed_for_memory_the_program_took_is_its_memory_verdict(monkeypatch):
    """The attribution itself: the harness dies in a test while the sandbox's cgroup counts a new
    OOM kill: that test and every later one are `memory`; without a new kill it is the host's
    SandboxError."""
    from gspo_mcore.sandbox import session as session_module

    def killed(session):  # bwrap killed, and the harness (its own session) gone with it before the test
        session.sandbox.kill()
        session.sandbox.process.wait()
        procs = session.sandbox.slot.cgroup.directories[0] / "cgroup.procs"
        deadline = time.monotonic() + 10
        while procs.read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.01)

    with Session(HONEST, limits=FAST) as session:
        cgroup = session.sandbox.slot.cgroup if session.sandbox.slot else None
        if cgroup is None:
            pytest.skip("no cgroup here (not root)")
        killed(session)
        monkeypatch.setattr(type(cgroup), "oom_kills", lambda self: session.oom_kills + 1)
        runs = list(session.runs(["1 2\n", "3 4\n"]))
    assert [(r.memory_killed, r.signal) for r in runs] == [(True, 9), (True, 9)]
    assert [session_module.TestRun is type(r) for r in runs] == [True, True]
    monkeypatch.undo()
    with Session(HONEST, limits=FAST) as session:
        killed(session)
        with pytest.raises(session_module.SandboxError):
            session.run("1 2\n")


# ---- round 3, D: CPU time the limit does not see

UNWAITED_CHILDREN = textwrap.dedent("""
    import os, time
    def spin(seconds):
        end = time.process_time() + seconds
        while time.process_time() < end:
            pass
    for _ in range({children}):
        if os.fork() == 0:
            spin(0.6)
            os._exit(0)  # never waited for: wait4 of the test process does not count it
    spin(0.6)
    time.sleep(1.5)
    print(sum(map(int, input().split())))
""")


def test_cpu_in_children_never_waited_for_counts_against_the_limit():
    """2.4 s of CPU in four processes (three forked, never waited for) against a 1 s limit:
    `timeout` by the sandbox's whole CPU (its cgroup's), as the same work in one process is (old
    code: passed, wait4 saw 0.6 s); 0.6 s in one process passes."""
    if os.geteuid() != 0:
        pytest.skip("no cgroup here (not root)")
    limits = Limits(cpu_s=1, wall_s=6, memory_bytes=512 * 1024**2, processes=16)
    spread, alone = judge_programs([UNWAITED_CHILDREN.format(children=3), UNWAITED_CHILDREN.format(children=0)], ADD,
                                   limits=limits)
    assert spread.verdicts == ["timeout"] and alone.passed, (spread, alone)


# ---- round 3, F: the host's memory of a long line

def test_a_16_mib_one_line_output_is_compared_in_a_few_copies_of_its_size():
    """At the output cap, one line of 8M tokens differing in the last: compared token by token a
    chunk at a time, within 5 copies of the output of the host's memory (old code: every token a
    string object at once, ~470 MB); the same line with its last token right matches, and one
    more token or line on either side does not."""
    import tracemalloc

    want = "1 " * (8 * 1024 * 1024)
    got = want[:-2] + "2 "
    tracemalloc.start()
    try:
        assert not stdout_matches(got, want)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 5 * len(want), peak
    assert stdout_matches(want.replace(" ", "  "), want)
    assert not stdout_matches(want + "1", want) and not stdout_matches(want + "\n1", want)
    assert stdout_matches("1.0  2\n3", "1.0 2\n3\n") and not stdout_matches("1 2\n3", "1 2 3")


# ---- round 3, C: the checker starved by a candidate

SPINNERS = textwrap.dedent("""
    import os, time
    def spin(seconds):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass
    for _ in range(3):
        if os.fork() == 0:
            os.setsid()  # its own session: its own scheduler autogroup
            spin(1.0)
            os._exit(0)
    spin(1.0)
""")


def test_a_sandbox_takes_one_cpu_whatever_it_forks():
    """Four processes in sessions of their own spinning for 1 s of wall: the sandbox's cgroup
    bounds them to one CPU (old code: 2.0 s of CPU a second on this 2-core host, starving the
    host's checker, whose refusal of the expected output then masked the group)."""
    if os.geteuid() != 0:
        pytest.skip("no cgroup here (not root)")
    with Session(SPINNERS, limits=Limits(cpu_s=4, wall_s=6, processes=16), spare=False) as session:
        run = session.run("")
    assert run.status == "exited" and run.cpu_s <= 1.3 * run.wall_s, run


def test_a_checkers_refusal_of_the_expected_output_is_not_kept_for_the_group(monkeypatch):
    """A soundness check that failed (a moment a candidate loaded the host) is asked again for the
    next candidate, not cached for the group (old code: cached, every later group-mate an
    infrastructure error); one that passed is kept. The checker's wall clock is 10x its CPU limit."""
    from gspo_mcore.sandbox.judge import Checker

    checker = Checker("def check(i, o, e):\n    return o == e\n", FAST)
    assert checker.limits.wall_s == 10 * FAST.cpu_s and checker.limits.cpu_s == FAST.cpu_s
    answers = iter([None, None, None, True])  # the candidate's check fails; the expected one fails once, then passes
    asked = []

    def check(test, output):
        asked.append(output)
        return next(answers)

    monkeypatch.setattr(checker, "_check", check)
    test = Test("1\n", "2\n")
    with pytest.raises(launch.SandboxError, match="does not accept the expected output"):
        checker.accepts(test, "garbage")
    assert checker.accepts(test, "garbage too") is False and test in checker.sound
    assert asked == ["garbage", "2\n", "garbage too", "2\n"]
