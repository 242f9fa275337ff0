"""One sandbox per program: `Session(program, ...)` takes a started sandbox (bubblewrap and the
harness, waiting for a program: a spare started in the background while the previous program
ran, or one started now), gives it the program, and `run(input)` runs one test in a fresh
process and returns what the program printed or returned. No two programs share a sandbox: a
group's programs see nothing of each other (files, IPC, processes, the PID counter).

Infrastructure errors (`SandboxError`: the sandbox did not start, the harness crashed or broke
the protocol, or did not answer within the test's wall-clock limit plus a margin; no slot free)
are apart from anything the program does: a program's crash, timeout or garbage is a TestRun,
never an exception here. The host's wall clock kills the harness's whole process group (bwrap, its
PID namespace with it).

Sandboxes are started, and closed ones reaped, by one daemon thread per process (`_Launcher`):
bubblewrap's `--die-with-parent` is the death of the thread that started it, which must outlive
every sandbox (a reward call's worker thread does not)."""

from __future__ import annotations

import atexit
import marshal
import os
import select
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, replace
from queue import SimpleQueue
from typing import Iterator

from gspo_mcore.sandbox.cgroup import layout as cgroup_layout
from gspo_mcore.sandbox.cgroup import remove_parents
from gspo_mcore.sandbox.launch import (COMPILE_ENV, THREAD_ENV, SandboxError, SandboxSettings, SandboxUnavailable,
                                       Slot, cpp_command, cpp_compiler, cpp_pch, explain_failure, inside_path,
                                       start_harness)

STARTUP_S = 15.0  # bwrap + interpreter start: ~15-30 ms idle; a loaded node is slower
MARGIN_S = 5.0  # beyond a test's wall-clock limit, for the harness to report
LOOKAHEAD_CHARS = 8192  # an input sent ahead (Session.runs): well inside a pipe's 64 KiB, UTF-8 included
HARNESS_MEMORY = 64 * 1024**2  # the harness and bwrap in the sandbox's cgroup, beyond the test's limit
LANGUAGES = ("python", "cpp")


@dataclass(frozen=True)
class Limits:
    cpu_s: float = 4.0
    wall_s: float = 8.0
    memory_bytes: int = 1024**3  # address space: a forked interpreter maps ~30 MB of it before the program runs
    output_bytes: int = 16 * 1024**2  # stdout (functional: the returned value's JSON): more is `output_limit`
    file_bytes: int = 16 * 1024**2
    open_files: int = 64
    processes: int = 32  # the slot uid's processes and threads

    def as_dict(self) -> dict:
        return dict(self.__dict__)

    @classmethod
    def compile(cls, cpu_s: float = 10.0, memory_bytes: int = 2 * 1024**3) -> "Limits":
        """A C++ program's build (g++: the driver, cc1plus, as, ld), limits of its own: CPU time and
        address space per process, the wall clock at 3x the CPU time (a loaded node), the
        compiler's output (messages; the binary is a file: file_bytes, and the tmpfs's size)."""
        return cls(cpu_s=cpu_s, wall_s=3 * cpu_s, memory_bytes=memory_bytes, output_bytes=1024**2,
                   file_bytes=64 * 1024**2, open_files=256, processes=16)

    def sandbox_memory(self, settings: SandboxSettings) -> int:
        """The whole sandbox's memory (its cgroup): a test's address space, its tmpfs, the
        harness's copies of its output (the buffer, the report) and the harness itself."""
        return self.memory_bytes + settings.tmpfs_bytes + 3 * self.output_bytes + HARNESS_MEMORY


@dataclass(frozen=True)
class TestRun:
    status: str  # exited | signaled | timeout | output_limit
    exit_code: int | None
    signal: int | None
    stdout: str
    stderr: str  # its last 2000 characters
    result: str | None  # functional: the return value's JSON ({"value": ...} or {"unencodable": ...})
    wall_s: float
    cpu_s: float  # user + system of the test process and the children it waited for
    memory_killed: bool = False  # the sandbox's memory cgroup killed a process during it


class HarnessDied(SandboxError):
    """The harness's pipe broke: it is dead (the message holds its last words)."""


class _Reports:
    """The harness's framed messages (gspo_mcore.sandbox.harness: a 4-byte length, then marshal)
    with a deadline and a size cap. marshal is for trusted data only: the harness is ours, and no
    test process holds this pipe (what a program prints arrives as a string inside a report)."""

    def __init__(self, fd: int, cap: int):
        self.fd, self.cap, self.buffer = fd, cap, bytearray()
        self.poll = select.poll()  # not select.select: a process with over 1024 fds open
        self.poll.register(fd, select.POLLIN)

    def _fill(self, count: int, deadline: float, timeout_s: float) -> None:
        while len(self.buffer) < count:
            left = deadline - time.monotonic()
            if left <= 0 or not self.poll.poll(max(1, int(left * 1000))):
                raise SandboxError(f"sandbox: the harness did not answer within {timeout_s:g} s")
            chunk = os.read(self.fd, 1 << 20)
            if not chunk:
                raise SandboxError("sandbox: the harness exited")
            self.buffer += chunk

    def read(self, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        self._fill(4, deadline, timeout_s)
        size = int.from_bytes(self.buffer[:4], "big")
        if size > self.cap:
            raise SandboxError("sandbox: a harness report over the size cap")
        self._fill(4 + size, deadline, timeout_s)
        body, self.buffer = bytes(self.buffer[4:4 + size]), self.buffer[4 + size:]
        try:
            report = marshal.loads(body)
        except (ValueError, EOFError, TypeError):
            raise SandboxError("sandbox: a harness report that cannot be read") from None
        if not isinstance(report, dict):
            raise SandboxError("sandbox: a harness report that is not a dict")
        return report


def frame(message: dict) -> bytes:
    body = marshal.dumps(message)
    return len(body).to_bytes(4, "big") + body


class _Sandbox:
    """bubblewrap and the harness, started for one kind of program, waiting for its program."""

    def __init__(self, settings: SandboxSettings, kind: str):
        self.settings, self.kind = settings, kind
        self.slot = Slot(settings) if os.geteuid() == 0 and not settings.unsafe_no_isolation else None
        if os.geteuid() != 0 and not settings.unsafe_no_isolation:
            cgroup_layout(root=False)  # says once why there is no cgroup
        self.process: subprocess.Popen | None = None
        self.reports: _Reports | None = None
        # a compiled program's binary: the sandbox's own /tmp, or (unsafe: the host's /tmp) a directory of its own
        self.scratch = tempfile.mkdtemp(prefix="gspo-sandbox-") if settings.unsafe_no_isolation else None
        try:
            self.process = start_harness(settings, self.slot.cgroup if self.slot else None)
            self.send({"kind": kind, "pid_namespace": not settings.unsafe_no_isolation,
                       "path": inside_path(settings), "env": dict(THREAD_ENV),
                       "binary": os.path.join(self.scratch or "/tmp", "solution")})
        except BaseException:
            self.close()
            raise

    def send(self, message: dict) -> None:
        try:
            self.process.stdin.write(frame(message))
            self.process.stdin.flush()
        except OSError:
            raise HarnessDied(explain_failure(self.last_words())) from None

    def last_words(self) -> str:
        """The harness's (bwrap's) stderr, once it is dead or killed; how it ended when it had
        died by itself without a word (a signal from outside, the OOM killer)."""
        ended = self.process.poll()
        self.kill()
        try:
            said = self.process.stderr.read(4000).decode("utf-8", "replace")
        except (OSError, ValueError):
            said = ""
        if not said.strip() and ended is not None:
            how = f"killed by signal {-ended}" if ended < 0 else f"exit status {ended}"
            said = f"no message, {how}"
        return said

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)  # bwrap and its PID namespace: every test process dies
            except ProcessLookupError:
                pass

    def close(self) -> None:
        """Killed now; waited for, its cgroup removed and its slot freed by the launcher thread
        (a killed PID namespace takes a moment to empty)."""
        self.kill()
        _launcher().submit(self._reap)

    def _reap(self) -> None:
        if self.process is not None:
            self.process.wait()
            for stream in (self.process.stdin, self.process.stdout, self.process.stderr):
                try:
                    stream.close()
                except OSError:
                    pass
            self.process = None
        if self.slot is not None:
            self.slot.release()
            self.slot = None
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None


class _Launcher:
    """This process's sandbox starter (a daemon thread, with a started spare per (settings,
    kind), so that a program's sandbox is ready when its turn comes) and reaper (another: a
    killed sandbox's PID namespace and cgroup take a while to empty, which must not hold up the
    next start)."""

    def __init__(self):
        self.pid = os.getpid()
        self.jobs: SimpleQueue = SimpleQueue()
        self.reaps: SimpleQueue = SimpleQueue()
        self.lock = threading.Lock()
        self.spares: dict[tuple, Future] = {}
        for name, queue in (("sandbox-launcher", self.jobs), ("sandbox-reaper", self.reaps)):
            threading.Thread(target=self._serve, args=(queue,), name=name, daemon=True).start()

    @staticmethod
    def _serve(queue: SimpleQueue) -> None:
        while True:
            job = queue.get()
            try:
                job()
            except BaseException:  # a reaper's error (a cgroup that would not go) must not stop the thread
                pass

    def submit(self, job) -> None:
        """A reaping job."""
        self.reaps.put(job)

    def start(self, settings: SandboxSettings, kind: str) -> Future:
        future: Future = Future()

        def job() -> None:
            try:
                future.set_result(_Sandbox(settings, kind))
            except BaseException as err:
                future.set_exception(err)

        self.jobs.put(job)
        return future

    def take(self, settings: SandboxSettings, kind: str, spare: bool = True) -> _Sandbox:
        """A started sandbox (the spare, or one started now), and the next spare on its way."""
        if not spare:
            return self.start(settings, kind).result()
        with self.lock:
            future = self.spares.pop((settings, kind), None) or self.start(settings, kind)
            self.spares[(settings, kind)] = self.start(settings, kind)
        return future.result()

    def shutdown(self) -> None:
        """At exit: the spares killed and reaped, the closed sandboxes' reaping finished, the
        cgroups' parent directories removed (not in a forked child: the spares are its parent's)."""
        if os.getpid() != self.pid:
            return
        with self.lock:
            spares, self.spares = list(self.spares.values()), {}
        for future in spares:
            try:
                sandbox = future.result(timeout=STARTUP_S)
            except BaseException:
                continue
            sandbox.kill()
            sandbox._reap()
        drained: Future = Future()
        self.reaps.put(lambda: drained.set_result(None))
        try:
            drained.result(timeout=5.0)
        except BaseException:
            pass
        remove_parents()


_the_launcher: _Launcher | None = None
_launcher_lock = threading.Lock()


def _launcher() -> _Launcher:
    """This process's launcher (a forked child makes its own: the parent's thread and spares
    are not its)."""
    global _the_launcher
    with _launcher_lock:
        if _the_launcher is None or _the_launcher.pid != os.getpid():
            _the_launcher = _Launcher()
            atexit.register(_the_launcher.shutdown)
        return _the_launcher


class Session:
    """A program's sandbox, used for its tests one at a time; `close()` (or `with`) ends it.
    `spare=False`: a sandbox started now, not one started earlier (a check of this moment's
    machine). `language` "cpp": the program is C++ (stdin problems), compiled in the sandbox under
    `compile_limits` before its first test; `compiled` is the compiler's run (check `built`)."""

    def __init__(self, program: str, kind: str = "stdin", func_name: str | None = None,
                 limits: Limits = Limits(), settings: SandboxSettings | None = None, spare: bool = True,
                 language: str = "python", compile_limits: Limits | None = None):
        if kind not in ("stdin", "functional") or (kind == "functional" and not func_name):
            raise ValueError(f"sandbox: kind {kind!r} (functional needs func_name)")
        if language not in LANGUAGES or (language != "python" and kind != "stdin"):
            raise ValueError(f"sandbox: language {language!r} (one of {LANGUAGES}; C++ on stdin problems only)")
        self.settings = settings or SandboxSettings.from_env()
        self.limits, self.kind, self.language = limits, kind, language
        self.compile_limits = compile_limits or Limits.compile()
        self.compiled: TestRun | None = None
        self.sandbox: _Sandbox | None = None
        self.killed_for_memory: TestRun | None = None
        self.cpu_mark: float | None = None
        message = {"program": program, "func_name": func_name, "limits": limits.as_dict()}
        if language == "cpp":  # before any sandbox: no compiler is a one-line refusal, not a verdict
            message["compile"] = {"argv": cpp_command(self.settings), "limits": self.compile_limits.as_dict(),
                                  "env": COMPILE_ENV}
        bounds = [limits] + ([self.compile_limits] if language == "cpp" else [])
        try:
            self.sandbox = self._started(spare, message, max(b.sandbox_memory(self.settings) for b in bounds),
                                         max(b.processes for b in bounds) + 8)
            if language == "cpp":
                self.compiled = self._report(self.compile_limits)
        except BaseException:
            self.close()
            raise

    def _started(self, spare: bool, message: dict, memory_bytes: int, processes: int) -> _Sandbox:
        """A sandbox that said it is ready and took the program (its cgroup bounded first). A
        spare that failed to start, or died waiting before or after it said ready (its harness
        killed from outside, the machine short of memory), is replaced by one started now."""
        launcher = _launcher()
        for attempt in (spare, False):
            try:
                sandbox = launcher.take(self.settings, self.kind, spare=attempt)
            except SandboxError:  # the spare's start failed (no slot free then): once more, now
                if attempt:
                    continue
                raise
            sandbox.reports = _Reports(sandbox.process.stdout.fileno(), 8 * self.limits.output_bytes + 65536)
            try:
                ready = sandbox.reports.read(STARTUP_S)
                if ready == {"ready": True}:
                    cgroup = sandbox.slot.cgroup if sandbox.slot else None
                    if cgroup is not None:
                        cgroup.set_limits(memory_bytes, processes)
                    self.oom_kills = cgroup.oom_kills() if cgroup is not None else 0
                    self.cpu_mark = cgroup.cpu_seconds() if cgroup is not None else None
                    sandbox.send({**message, "uid": sandbox.slot.uid if sandbox.slot else None})
                    return sandbox
                error = SandboxError(f"sandbox: the harness said {str(ready)[:200]}")
            except OSError as err:  # the cgroup's files
                error = SandboxError(f"sandbox: {err}")
            except HarnessDied as err:  # it died after it said ready
                error = err
            except SandboxError:  # it died before it said ready, or did not answer
                error = HarnessDied(explain_failure(sandbox.last_words()))
            if attempt and isinstance(error, HarnessDied):  # a spare that died waiting: one started now instead
                sandbox.close()
                continue
            sandbox.close()
            raise error
        raise AssertionError("unreachable")

    def run(self, test_input: str) -> TestRun:
        """One test of the session's program."""
        self._send({"input": test_input})
        return self._report()

    def _send(self, message: dict) -> None:
        if self.killed_for_memory is None:
            try:
                self.sandbox.send(message)
            except HarnessDied:
                if not self._memory_killed_since_ready():
                    raise

    def _cgroup(self):
        return self.sandbox.slot.cgroup if self.sandbox.slot else None

    def _memory_killed_since_ready(self) -> bool:
        """The sandbox's memory cgroup killed a process since the last kill counted: what filled it
        (tmpfs pages, inodes and dentries, charged to it and not to the tmpfs's size) is the program's."""
        cgroup = self._cgroup()
        return cgroup is not None and cgroup.oom_kills() > self.oom_kills

    def runs(self, inputs: list[str]) -> Iterator[TestRun]:
        """The tests of `inputs` in turn, each next input sent before this one's report is read
        (when it is small), so that the harness starts the next test while the host judges this
        one. Stop iterating only to close the session: a test may be on its way."""
        pending = False
        for index, test_input in enumerate(inputs):
            if not pending:
                self._send({"input": test_input})
            pending = index + 1 < len(inputs) and len(inputs[index + 1]) <= LOOKAHEAD_CHARS
            if pending:
                # a pipe's buffer holds it: were it larger, we would block on it while the
                # harness blocks on a report we are not reading
                self._send({"input": inputs[index + 1]})
            yield self._report()

    @property
    def built(self) -> bool:
        """A compiled program's build succeeded (within its limits); True for Python."""
        run = self.compiled
        return run is None or (run.status == "exited" and run.exit_code == 0 and run.cpu_s <= self.compile_limits.cpu_s
                               and not run.memory_killed)

    def _report(self, limits: Limits | None = None) -> TestRun:
        if self.killed_for_memory is not None:  # the sandbox died of the program's memory: every later test too
            return self.killed_for_memory
        cgroup = self._cgroup()
        try:
            report = self.sandbox.reports.read((limits or self.limits).wall_s + MARGIN_S)
        except SandboxError:
            # The harness killed by the sandbox's memory cgroup while it held this test's output:
            # the program's verdict, not an infrastructure error.
            if not self._memory_killed_since_ready():
                raise
            self.killed_for_memory = TestRun("signaled", None, signal.SIGKILL, "", "the sandbox's memory limit killed "
                                             "its harness", None, 0.0, 0.0, memory_killed=True)
            return self.killed_for_memory
        for key in ("stdout", "stderr", "result"):  # the harness sends the bytes as read
            if isinstance(report.get(key), bytes):
                report[key] = report[key].decode("utf-8", "replace")
        try:
            run = TestRun(**report)
        except TypeError:
            raise SandboxError(f"sandbox: a malformed harness report ({sorted(report)})") from None
        used = cgroup.cpu_seconds() if cgroup is not None and self.cpu_mark is not None else None
        if used is not None:
            # The harness's wait4 counts the test process and the children it waited for only: work
            # in forked children never waited for passed the limit. The sandbox's whole CPU since
            # the previous report (the harness's small share, a next test sent ahead just begun)
            # counts where it is more.
            run = replace(run, cpu_s=max(run.cpu_s, round(used - self.cpu_mark, 6)))
            self.cpu_mark = used
        if cgroup is not None and run.signal == signal.SIGKILL:
            kills = cgroup.oom_kills()
            if kills > self.oom_kills:
                self.oom_kills = kills
                run = replace(run, memory_killed=True)
        return run

    def close(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close()
            self.sandbox = None

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_languages(languages, settings: SandboxSettings | None = None, prepare: bool = False) -> None:
    """SandboxUnavailable in one line where a language of `languages` cannot be judged here (cpp:
    no g++ in the sandbox's /usr); with cpp, the precompiled header found (`prepare`: built where
    missing, a few seconds once per host), so that the sandboxes started from now on hold it."""
    if "cpp" in languages:
        cpp_pch(cpp_compiler(settings or SandboxSettings.from_env()), build=prepare)


_checked: set[bool] = set()


def check_sandbox(settings: SandboxSettings | None = None) -> None:
    """Start one sandbox and run one trivial test, once per process: a SandboxUnavailable with one
    line saying why (and what to install or enable) where that fails."""
    settings = settings or SandboxSettings.from_env()
    if settings.unsafe_no_isolation in _checked:
        return
    try:
        with Session("print(input())", settings=settings, spare=False) as session:
            run = session.run("ok\n")
    except SandboxError as err:
        raise SandboxUnavailable(str(err)) from None
    if run.stdout.strip() != "ok":
        raise SandboxUnavailable(f"sandbox: a trivial program did not run ({run.status}, {run.stderr.strip()[-200:]!r})")
    _checked.add(settings.unsafe_no_isolation)
