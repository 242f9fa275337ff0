"""The harness inside the sandbox: runs one program on test inputs, one forked process per test,
and reports what it printed or returned. Standard library only (it runs on the base interpreter
with `-I -S`, nothing of the project importable); trusted, but it never sees an expected output.

Protocol: messages framed by a 4-byte big-endian length, marshal-encoded plain dicts (builtin
modules only: importing json costs more than starting the interpreter). The host writes our stdin
and reads our stdout, which no test process holds: what a program prints travels inside a report's
string field, never as protocol. A harness judges one program: a sandbox may be started before
its program is known (a spare), so the program comes in the second message.
  host -> {"kind": "stdin" | "functional", "pid_namespace", "path": [...], "env": {...}, "binary"}
  harness -> {"ready": True}
  host -> {"program", "func_name", "uid", "limits": {...}[, "compile": {"argv", "limits", "env"}]}
  harness (a compiled language only) -> the compiler's run, a report as below
  host -> {"input": str}  (functional: a JSON list of the call's arguments), one per test
  harness -> {"status": "exited" | "signaled" | "timeout" | "output_limit", "exit_code", "signal",
              "stdout", "stderr", "result" (bytes, as the test process wrote them; functional: the JSON
              it wrote), "wall_s", "cpu_s"}
End of input ends the harness. `path`: where the stated packages are (put on sys.path); `env`:
added to the test processes' environment (thread pools held to one thread); `binary`: where a
compiled program goes.

A compiled program (C++) is built once, before its first test, in a process set up as a test
is (the slot's uid, the compile's own rlimits), the source on its stdin, the binary in the
sandbox's /tmp; each test then execs that binary in a test process.

A test process: a new session, stdin/stdout/stderr on pipes to us (functional: fd 3 for the
return value), every other descriptor closed, our uid dropped to `uid` (the kernel enforces
RLIMIT_NPROC only for non-root users, and a different uid cannot signal, ptrace or read the
/proc fds of this harness), then rlimits, then the program; then, as CPython's own exit does,
its non-daemon threads are waited for and its atexit functions run (`threading.Thread(target=
main).start()`, the contest idiom, prints from a thread after the module body returned), then
its streams are flushed. When the test process ends or its time is up, every process we may
signal is killed (kill(-1): this is a fresh PID namespace), so nothing a test left running
survives into the next test. Its CPU time (user + system, from wait4) is reported, and the host
compares it to the limit: RLIMIT_CPU counts whole seconds only.
"""

import atexit
import gc
import marshal
import os
import resource
import select
import signal
import sys
import time

# A functional program's namespace starts with these (LiveCodeBench's functional problems use
# typing names such as List without importing them); imported once, before the first fork, by a
# functional harness only (a stdin harness starts faster without them: ~50 ms on a loaded core).
PRELUDE = ("from typing import *\nfrom collections import *\nfrom heapq import *\nfrom bisect import *\n"
           "from itertools import *\nfrom functools import *\nfrom math import *\nimport math, collections, "
           "heapq, bisect, itertools, functools, re, string, sys\n")
RESULT_FD = 3
STDERR_KEPT = 2000


def strict_encode(value, _type=type, _isfinite=__import__("math").isfinite, depth=0):
    """JSON-ready copy of `value` built only from the exact builtin types (a subclass of int, a
    class with its own __eq__ or __str__ is refused): the host compares plain data."""
    if depth > 100:
        raise TypeError("nested deeper than 100")
    kind = _type(value)
    if value is None or kind is bool or kind is int or kind is str:
        return value
    if kind is float:
        if not _isfinite(value):
            raise TypeError("returned a non-finite float")
        return value
    if kind is list or kind is tuple:
        return [strict_encode(item, depth=depth + 1) for item in value]
    if kind is dict:
        out = {}
        for key, item in value.items():
            if _type(key) is not str:
                raise TypeError(f"a dict key of type {_type(key).__name__}")
            out[key] = strict_encode(item, depth=depth + 1)
        return out
    raise TypeError(f"returned {kind.__name__}, not a builtin value")


def _set_limits(limits):
    def both(which, value):
        resource.setrlimit(which, (value, value))

    # whole seconds: SIGXCPU at the limit rounded up, SIGKILL a second later; the host compares
    # the CPU time measured after the run with the exact limit
    seconds = max(1, -int(-limits["cpu_s"] // 1))
    resource.setrlimit(resource.RLIMIT_CPU, (seconds, seconds + 1))
    both(resource.RLIMIT_AS, limits["memory_bytes"])
    both(resource.RLIMIT_FSIZE, limits["file_bytes"])
    both(resource.RLIMIT_NOFILE, limits["open_files"])
    both(resource.RLIMIT_NPROC, limits["processes"])
    both(resource.RLIMIT_CORE, 0)
    stack = min(limits["memory_bytes"] // 4, 256 * 1024 * 1024)  # deep recursion needs the C stack
    hard = resource.getrlimit(resource.RLIMIT_STACK)[1]
    resource.setrlimit(resource.RLIMIT_STACK, (stack if hard == resource.RLIM_INFINITY else min(stack, hard), hard))


def _finish_like_python(_modules=sys.modules, _run_exitfuncs=atexit._run_exitfuncs):
    """What CPython does when a program's main module returns: wait for its non-daemon threads,
    then run its atexit functions (their errors printed, as CPython prints them)."""
    threading = _modules.get("threading")
    try:
        if threading is not None:
            threading._shutdown()
    finally:
        _run_exitfuncs()


def _regular_streams(messages):
    """A compiler's streams that nothing it reads can wait on: `#include "/dev/stdout"` (or stdin,
    stderr, /proc/self/fd/N) opened a pipe the compiler itself held, and its read waited for the
    wall clock. /dev/null in, /dev/null out, its messages into a regular file the harness reads."""
    null = os.open("/dev/null", os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    out = os.open(messages, os.O_WRONLY | os.O_TRUNC)  # made by the harness: its to read and remove
    os.dup2(out, 2)
    os.close(out)


def _enter(request, fds, limits):
    """The forked test process made what a test runs in: its own session, its pipes as fds 0-2
    (3), nothing else open, the slot's uid, the limits, text streams."""
    os.setsid()
    try:  # the memory cgroup's first victim, never us (only root's sandboxes have a cgroup; in a
        # user namespace our non-dumpable /proc files are not the user's to write)
        with open("/proc/self/oom_score_adj", "w") as adjust:
            adjust.write("1000")
    except OSError:
        pass
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    os.closerange(len(fds), 1 << 16)
    uid = request.get("uid")
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    _set_limits(limits)
    os.chdir("/tmp")
    sys.setrecursionlimit(100000)
    sys.stdin = open(0, "r", encoding="utf-8", errors="surrogateescape", closefd=False)
    sys.stdout = open(1, "w", encoding="utf-8", errors="replace", closefd=False)
    sys.stderr = open(2, "w", encoding="utf-8", errors="replace", closefd=False)


def _child(request, fds, limits, argv=None, env=None, messages=None, _exit=os._exit):
    """In the forked test process: never returns (`_exit` bound here: the program may replace
    os._exit). `argv`: a binary to exec (the compiler, a compiled program) instead of the Python
    program. `messages`: the compiler's run: stdin and stdout /dev/null, stderr this regular file."""
    code = 1
    try:
        _enter(request, fds, limits)
        if messages is not None:
            _regular_streams(messages)
    except BaseException as err:  # setting up the test process: the harness's fault, said on the test's stderr
        os.write(2, f"harness: test process set-up failed: {err!r}\n".encode())
        _exit(1)
    if argv:
        try:
            os.execve(argv[0], argv, env if env is not None else dict(os.environ))
        except BaseException as err:  # a binary that is not there (its build failed): the program's runtime error
            os.write(2, f"harness: cannot run {argv[0]}: {err!r}\n".encode())
        _exit(127)
    try:
        namespace = {"__name__": "__main__", "__builtins__": __builtins__}
        if request["kind"] == "functional":
            exec(PRELUDE, namespace)
        try:
            exec(compile(request["program"], "<solution>", "exec"), namespace)
            if request["kind"] == "functional":
                import json  # preloaded by a functional harness: free here
                arguments = json.loads(sys.stdin.read())
                solution = namespace.get("Solution")
                target = getattr(solution(), request["func_name"]) if solution is not None \
                    else namespace[request["func_name"]]
                value = target(*arguments)
                try:
                    payload = json.dumps({"value": strict_encode(value)})
                except (TypeError, ValueError, RecursionError) as err:
                    payload = json.dumps({"unencodable": str(err)[:200]})
                with open(RESULT_FD, "w", closefd=False) as out:
                    out.write(payload)
            code = 0
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        except BaseException:
            import traceback
            traceback.print_exc()
            code = 1
        try:
            _finish_like_python()
        except BaseException:
            code = code or 1
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                code = code or 1
    finally:
        try:
            _exit(int(code) & 0xFF)
        except BaseException:  # int() itself replaced: still never return into the harness's code
            _exit(1)


def _kill_all(request, pid):
    """Every process the test left. In our own PID namespace: every one we may signal but us and
    PID 1 (a test's child that made its own session is caught too); outside one (the unsafe
    mode), kill(-1) would reach the host's processes: the test's process group only."""
    try:
        if request.get("pid_namespace"):
            os.kill(-1, signal.SIGKILL)
        else:
            os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


def _wait_until_alone(deadline):
    """In our PID namespace: until only PID 1 (bwrap, which reaps orphans) and we are left. The
    kernel counts a uid's processes until they are reaped: a test's killed fork bomb must not make
    the next test's forks fail."""
    me = str(os.getpid())
    while time.monotonic() < deadline:
        if not [pid for pid in os.listdir("/proc") if pid.isdigit() and pid not in ("1", me)]:
            return
        time.sleep(0.001)


class _Exchange:
    """A running test's pipes: its input written as it reads, its output read up to the cap, until
    it has exited and every writer of its pipes is gone, or the deadline."""

    def __init__(self, request, pid, writer, data, readers, stderr_fd, cap):
        self.request, self.pid, self.data, self.readers, self.stderr_fd = request, pid, data, readers, stderr_fd
        self.cap = cap
        self.poll, self.open = select.poll(), set()
        self.pidfd = os.pidfd_open(pid)
        self.writer, self.exited, self.status = writer, False, None
        os.set_blocking(writer, False)
        if data:
            self._watch(writer, select.POLLOUT)
        else:
            self._close_writer()
        for fd in [*readers, self.pidfd]:
            self._watch(fd, select.POLLIN)

    def _watch(self, fd, events):
        self.poll.register(fd, events)
        self.open.add(fd)

    def _forget(self, fd):
        self.poll.unregister(fd)
        self.open.discard(fd)

    def run(self, deadline):
        while not (self.exited and not self.open) and self.status is None:
            left = deadline - time.monotonic()
            if left <= 0:
                self.status = "timeout"
                break
            for fd, _ in self.poll.poll(max(1, int(left * 1000))):
                if fd not in self.open:  # closed earlier in this same batch
                    continue
                if fd == self.writer:
                    self._write()
                elif fd == self.pidfd:
                    self._forget(self.pidfd)
                    self.exited = True
                    self._close_writer()  # it may have ended without reading all its input
                    _kill_all(self.request, self.pid)  # what it left behind; its pipes' writers go with it
                else:
                    self._read(fd)
        return self.status

    def _write(self):
        try:
            sent = os.write(self.writer, self.data[:65536])
        except BlockingIOError:
            sent = 0
        except BrokenPipeError:  # the test stopped reading: the rest is dropped
            sent = len(self.data)
        self.data = self.data[sent:]
        if not self.data:
            self._close_writer()

    def _read(self, fd):
        chunk = os.read(fd, 65536)
        if not chunk:
            self._forget(fd)
            return
        buffer = self.readers[fd]
        buffer += chunk
        if fd == self.stderr_fd:
            del buffer[:-STDERR_KEPT]
        elif len(buffer) > self.cap:
            del buffer[self.cap:]
            self.status = "output_limit"

    def _close_writer(self):
        if self.writer >= 0:
            if self.writer in self.open:
                self._forget(self.writer)
            os.close(self.writer)
            self.writer = -1

    def close(self):
        self._close_writer()
        for fd in list(self.readers) + [self.pidfd]:
            os.close(fd)


def compile_program(request):
    """The compiler's run on the program (a source file, never a stream: _regular_streams), its
    report with the messages' tail as its stderr; the source and the messages removed after."""
    build, binary = request["compile"], request["binary"]
    folder = os.path.dirname(binary)
    source, messages = os.path.join(folder, "solution.cc"), os.path.join(folder, "compiler-messages")
    with open(source, "w", encoding="utf-8", errors="surrogateescape") as out:
        out.write(request["program"])
    os.chmod(source, 0o644)
    # made here, writable by the compiler's uid: the harness (root without CAP_DAC_OVERRIDE, or
    # the user) must read it and remove it from the sticky /tmp after
    made = os.open(messages, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(made, 0o622)
    os.close(made)
    argv = [source if arg == "-" else arg for arg in build["argv"]] + ["-o", binary]
    report = run_test(request, "", argv, build["limits"], {**os.environ, **build["env"]}, messages=messages)
    try:
        with open(messages, "rb") as said:
            size = said.seek(0, os.SEEK_END)
            said.seek(max(0, size - STDERR_KEPT))
            report["stderr"] = said.read()
        if size > build["limits"]["output_bytes"] and report["status"] == "exited":
            report["status"] = "output_limit"
    except OSError:
        pass
    for path in (source, messages):
        try:
            os.unlink(path)
        except OSError:
            pass
    return report


def run_test(request, test_input, argv=None, limits=None, env=None, messages=None):
    """One test in a fresh process: the Python program, or `argv` (a compiled program, the
    compiler, with `env`: default ours) on `test_input`; under `limits` (default: the test's)."""
    functional = request["kind"] == "functional" and argv is None
    limits = limits or request["limits"]
    pipes = [os.pipe() for _ in range(4 if functional else 3)]  # stdin, stdout, stderr[, result]
    started = time.monotonic()
    # Our objects out of the collector's reach (O(1)): a collection in the test process would
    # otherwise write into every one of them, copying our heap page by page (bench/sandbox.py:
    # ~230 page copies, 1-2.5 ms of CPU a test); the harness makes no reference cycles to leak.
    gc.freeze()
    pid = os.fork()
    if pid == 0:
        _child(request, [pipes[0][0]] + [w for _, w in pipes[1:]], limits, argv, env, messages=messages)
    for index, (r, w) in enumerate(pipes):
        os.close(r if index == 0 else w)
    outputs = [r for r, _ in pipes[1:]]
    exchange = _Exchange(request, pid, pipes[0][1], test_input.encode("utf-8", "surrogateescape"),
                         {fd: bytearray() for fd in outputs}, outputs[1], limits["output_bytes"])
    status = exchange.run(started + limits["wall_s"])
    _kill_all(request, pid)
    _, wait_status, usage = os.wait4(pid, 0)  # its CPU time and that of the children it waited for
    if request.get("pid_namespace"):
        _wait_until_alone(time.monotonic() + 2.0)
    exchange.close()
    # The bytes as read: the host decodes them (in its own memory). Decoded here, 16 MiB of
    # invalid UTF-8 was ~9x its size in the sandbox's cgroup (U+FFFD as UCS-2, then UTF-8 in the report).
    texts = [bytes(exchange.readers.pop(fd)) for fd in outputs]
    return {
        "status": status or ("signaled" if os.WIFSIGNALED(wait_status) else "exited"),
        "exit_code": os.WEXITSTATUS(wait_status) if os.WIFEXITED(wait_status) else None,
        "signal": os.WTERMSIG(wait_status) if os.WIFSIGNALED(wait_status) else None,
        "stdout": texts[0], "stderr": texts[1], "result": texts[2] if functional else None,
        "wall_s": round(time.monotonic() - started, 6),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 6),
    }


def read_message(fd):
    """One framed message from `fd`, or None at its end."""
    def exactly(count):
        data = bytearray()
        while len(data) < count:
            chunk = os.read(fd, count - len(data))
            if not chunk:
                return None
            data += chunk
        return bytes(data)

    head = exactly(4)
    body = exactly(int.from_bytes(head, "big")) if head is not None else None
    return marshal.loads(body) if body is not None else None


def write_message(fd, message):
    body = marshal.dumps(message)
    for data in (len(body).to_bytes(4, "big"), memoryview(body)):  # no copy of the body to frame it
        while data:
            data = data[os.write(fd, data):]


def main():
    if os.geteuid() != 0:  # tests keep our uid (a user namespace): close our /proc fds and memory to them
        import ctypes
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0
    reports = os.dup(1)
    os.dup2(2, 1)  # our own stray prints must not reach the protocol
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # a test closing its stdin early is the test's business
    request = read_message(0)
    sys.path.extend(request.get("path") or ())  # the stated packages, after the standard library
    os.environ.update(request.get("env") or {})  # inherited by the forked tests (numpy's OpenBLAS reads it)
    if request["kind"] == "functional":
        exec(PRELUDE, {})
        import json  # noqa: F401 (for the test processes: loaded once, before they fork)
    write_message(reports, {"ready": True})
    request.update(read_message(0) or {})  # the program, its uid and limits
    if "program" not in request:
        return
    argv = None
    if request.get("compile"):
        argv = [request["binary"]]
        write_message(reports, compile_program(request))
    while (message := read_message(0)) is not None:
        write_message(reports, run_test(request, message["input"], argv))


if __name__ == "__main__":
    main()
