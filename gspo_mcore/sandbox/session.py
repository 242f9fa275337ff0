"""One sandbox per program: `Session(program, ...)` starts the harness in bubblewrap, `run(input)`
runs one test in a fresh process and returns what the program printed or returned.

Infrastructure errors (`SandboxError`: the sandbox did not start, the harness crashed or broke
the protocol, or did not answer within the test's wall-clock limit plus a margin) are apart
from anything the program does: a program's crash, timeout or garbage is a TestRun, never an
exception here. The host's wall clock kills the harness's whole process group (bwrap, its PID
namespace with it)."""

from __future__ import annotations

import marshal
import os
import select
import signal
import subprocess
import time
from dataclasses import dataclass

from gspo_mcore.common.errors import EngineError
from gspo_mcore.sandbox.launch import SandboxSettings, SandboxUnavailable, Slot, explain_failure, start_harness

STARTUP_S = 15.0  # bwrap + interpreter start: ~50 ms idle; a loaded node is slower
MARGIN_S = 5.0  # beyond a test's wall-clock limit, for the harness to report


class SandboxError(EngineError):
    """An infrastructure error: never a verdict on the program."""


@dataclass(frozen=True)
class Limits:
    cpu_s: float = 4.0
    wall_s: float = 8.0
    memory_bytes: int = 1024**3  # address space: a forked interpreter maps ~30 MB of it before the program runs
    output_bytes: int = 1024**2
    file_bytes: int = 16 * 1024**2
    open_files: int = 64
    processes: int = 32  # the slot uid's processes and threads

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class TestRun:
    status: str  # exited | signaled | timeout | output_limit
    exit_code: int | None
    signal: int | None
    stdout: str
    stderr: str  # its last 2000 characters
    result: str | None  # functional: the return value's JSON ({"value": ...} or {"unencodable": ...})
    wall_s: float
    cpu_s: float


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


class Session:
    """A program's sandbox, used for its tests one at a time; `close()` (or `with`) ends it."""

    def __init__(self, program: str, kind: str = "stdin", func_name: str | None = None,
                 limits: Limits = Limits(), settings: SandboxSettings | None = None):
        if kind not in ("stdin", "functional") or (kind == "functional" and not func_name):
            raise ValueError(f"sandbox: kind {kind!r} (functional needs func_name)")
        self.settings = settings or SandboxSettings.from_env()
        self.limits = limits
        self.slot = Slot(self.settings) if os.geteuid() == 0 else None
        self.process: subprocess.Popen | None = None
        try:
            self.process = start_harness(self.settings)
            self.reports = _Reports(self.process.stdout.fileno(), 8 * limits.output_bytes + 65536)
            self._send({"program": program, "kind": kind, "func_name": func_name,
                        "uid": self.slot.uid if self.slot else None, "limits": limits.as_dict(),
                        "pid_namespace": not self.settings.unsafe_no_isolation})
            try:
                ready = self.reports.read(STARTUP_S)
            except SandboxError:
                raise SandboxError(explain_failure(self._stderr())) from None
            if ready != {"ready": True}:
                raise SandboxError(f"sandbox: the harness said {str(ready)[:200]}")
        except BaseException:
            self.close()
            raise

    def _send(self, message: dict) -> None:
        try:
            self.process.stdin.write(frame(message))
            self.process.stdin.flush()
        except OSError:
            raise SandboxError(explain_failure(self._stderr())) from None

    def _stderr(self) -> str:
        """The harness's (bwrap's) last words, once it is dead or killed."""
        self._kill()
        try:
            return self.process.stderr.read(4000).decode("utf-8", "replace")
        except (OSError, ValueError):
            return ""

    def run(self, test_input: str, program: str | None = None) -> TestRun:
        """One test of the session's program, or (`program`) of another: from then on the
        session's (a group's programs judged in turn in one sandbox)."""
        self._send({"input": test_input, **({"program": program} if program is not None else {})})
        report = self.reports.read(self.limits.wall_s + MARGIN_S)
        try:
            return TestRun(**report)
        except TypeError:
            raise SandboxError(f"sandbox: a malformed harness report ({sorted(report)})") from None

    def _kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)  # bwrap and its PID namespace: every test process dies
            except ProcessLookupError:
                pass
            self.process.wait()

    def close(self) -> None:
        if self.process is not None:
            self._kill()
            for stream in (self.process.stdin, self.process.stdout, self.process.stderr):
                try:
                    stream.close()
                except OSError:
                    pass
            self.process = None
        if self.slot is not None:
            self.slot.release()
            self.slot = None

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_checked: set[bool] = set()


def check_sandbox(settings: SandboxSettings | None = None) -> None:
    """Start one sandbox and run one trivial test, once per process: a SandboxUnavailable with one
    line saying why (and what to install or enable) where that fails."""
    settings = settings or SandboxSettings.from_env()
    if settings.unsafe_no_isolation in _checked:
        return
    try:
        with Session("print(input())", settings=settings) as session:
            run = session.run("ok\n")
    except SandboxError as err:
        raise SandboxUnavailable(str(err)) from None
    if run.stdout.strip() != "ok":
        raise SandboxUnavailable(f"sandbox: a trivial program did not run ({run.status}, {run.stderr.strip()[-200:]!r})")
    _checked.add(settings.unsafe_no_isolation)
