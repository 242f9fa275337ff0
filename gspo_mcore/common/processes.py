"""Child processes that never outlive the run: servers in their own process group, stopped on
every exit path, tied to the parent by the kernel (also on SIGKILL), their logs free of secrets.
Used for engine servers (gspo_mcore.engines) and reward and tool workers (gspo_mcore.rewards, gspo_mcore.tools)."""

from __future__ import annotations

import ctypes
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit, urlunsplit

from gspo_mcore.common.errors import InputError
from gspo_mcore.common.http import HTTPRequestError, get_json

REDACTED = b"<redacted>"

# A launcher's identity (torchrun / torch.distributed.run): a server started from a trainer
# rank that inherits them joins the trainer's rendezvous and hangs at start-up (measured).
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def child_env(env: dict | None = None) -> dict:
    """`env` (default: ours) without a launcher's identity, for a child that is not a trainer rank."""
    env = dict(os.environ if env is None else env)
    for key in list(env):
        if key in LAUNCHER_VARS or key.startswith("TORCHELASTIC_"):
            del env[key]
    return env



def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """In a child between fork and exec (Linux): the kernel sends it `sig` when the process that
    started it dies, by any signal, SIGKILL included, so a killed trainer orphans no server
    (SGLang's launcher takes its own workers down on SIGTERM). Elsewhere: nothing."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return
    PR_SET_PDEATHSIG = 1
    libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def exit_with_parent(poll_s: float = 1.0) -> None:
    """In a worker (reward, tool): a daemon thread that ends this process once its parent is
    gone. The kernel's parent-death signal (die_with_parent) fires when the starting *thread*
    ends, and workers are also started, and replaced, from rollout threads."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def start_redacted(cmd: list[str], out, secrets: tuple[str, ...], env: dict | None = None,
                   new_session: bool = False) -> subprocess.Popen:
    """Start `cmd` (stderr into stdout), its output copied to the binary file `out` by a daemon
    thread with every one of `secrets` replaced: SGLang logs its arguments, the API key among
    them. Without secrets the child writes to `out` itself."""
    kwargs = dict(stderr=subprocess.STDOUT, env=child_env(env), start_new_session=new_session,
                  # The kernel ties it to the starting *thread*: only the main thread's
                  # children, or a thread's end kills them.
                  preexec_fn=die_with_parent if in_main_thread() else None)
    secrets = tuple(s for s in secrets if s)
    if not secrets:
        return subprocess.Popen(cmd, stdout=out, **kwargs)
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, **kwargs)
    threading.Thread(target=_copy_redacted, args=(process.stdout, out, secrets), daemon=True).start()
    return process


def _copy_redacted(source, out, secrets: tuple[str, ...]) -> None:
    for line in iter(source.readline, b""):
        for secret in secrets:
            line = line.replace(secret.encode(), REDACTED)
        out.write(line)
        out.flush()


class ServerStartError(InputError):
    def __init__(self, message: str, transient: bool = False, port_taken: bool = False):
        super().__init__(message)
        self.transient, self.port_taken = transient or port_taken, port_taken


def log_tail(log_file: Path, tail_bytes: int = 65536, since: int = 0) -> list[str]:
    """The lines of the log's last `tail_bytes`, from byte `since` on ([] if it cannot be read)."""
    try:
        with open(log_file, "rb") as f:
            f.seek(max(since, f.seek(0, os.SEEK_END) - tail_bytes))
            return f.read().decode(errors="replace").splitlines()
    except OSError:
        return []


def last_error_line(log_file: Path, tail_bytes: int = 65536) -> str:
    """The last line of the log's tail that names an error (a Python exception's last line)."""
    hits = [ln.strip() for ln in log_tail(log_file, tail_bytes) if "Error" in ln or "Exception" in ln]
    return hits[-1][:300] if hits else ""


_STOPPING_AT_ONCE = False
SERVER_TMP_PREFIX = "gspo-server-"  # + the starting process's id: a server's TMPDIR
# The servers make Unix sockets in their TMPDIR (SGLang's ZMQ IPC files are `tempfile` names,
# `<TMPDIR>/tmpXXXXXXXX`; vLLM's, `<VLLM_RPC_BASE_PATH = TMPDIR>/<uuid4>` in
# utils/network_utils.get_open_zmq_ipc_path), and a socket's path must fit in sockaddr_un.sun_path:
# 107 bytes. Room is left for the longer name, a uuid4's 36 bytes.
SOCKET_PATH_MAX = 107
SOCKET_NAME_ROOM = 36
SHORT_TMP_ROOT = "/tmp"


def server_tmp_root() -> Path:
    """Where a server's TMPDIR is made: the user's temporary directory, unless the sockets made in
    it could not be named there (a long TMPDIR: a Slurm job's scratch path, a test's tmp_path),
    then /tmp. Either way the directory is the server's own and goes when it stops."""
    root = Path(tempfile.gettempdir())
    longest_dir = len(str(root / f"{SERVER_TMP_PREFIX}{2 ** 22}-xxxxxxxx"))
    return root if longest_dir + 1 + SOCKET_NAME_ROOM <= SOCKET_PATH_MAX else Path(SHORT_TMP_ROOT)


def remove_orphaned_tmp_dirs() -> list[Path]:
    """Servers' TMPDIRs left by processes that were SIGKILLed before they could stop their servers
    (`gspo-server-<pid>-*`, that pid gone); what was removed."""
    removed = []
    for path in (p for root in dict.fromkeys([Path(tempfile.gettempdir()), server_tmp_root()])
                 for p in root.glob(f"{SERVER_TMP_PREFIX}*-*")):
        pid = path.name.removeprefix(SERVER_TMP_PREFIX).partition("-")[0]
        if not pid.isdigit() or pid_running(int(pid)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def pid_running(pid: int) -> bool:
    """Whether a process `pid` runs on this host (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_at_once() -> None:
    """From here on servers are killed, not asked to stop: the user asked twice (a second Ctrl-C)."""
    global _STOPPING_AT_ONCE
    _STOPPING_AT_ONCE = True


class ManagedServer:
    """A server subprocess in its own process group, its output streamed to `log_file` (with
    `secrets` redacted). `with ManagedServer(...) as server:` starts it, waits for /health, and
    always stops it. `command_for_port(port)`: its command on another port, for a retry when its
    port was taken (`url` then names the new port: read it after `ready`)."""

    def __init__(self, cmd: list[str], url: str, log_file: str | Path, env: dict | None = None,
                 startup_timeout_s: float = 300.0, secrets: tuple[str, ...] = (),
                 command_for_port: Callable[[int], list[str]] | None = None):
        self.cmd, self.url, self.log_file = cmd, url.rstrip("/"), Path(log_file)
        self.command_for_port = command_for_port
        self.env, self.startup_timeout_s, self.secrets = env, startup_timeout_s, secrets
        self.process: subprocess.Popen | None = None
        self._group_killed = False
        self.log_start = 0
        self.tmp_dir: Path | None = None

    @classmethod
    def on_free_port(cls, command_for_port: Callable[[int], list[str]], log_file: str | Path,
                     host: str = "127.0.0.1", **options) -> "ManagedServer":
        """A server on `host` at a port free now: its command `command_for_port(port)`, its URL that
        port's, and a retry after the port was taken goes to another (`ready`)."""
        from gspo_mcore.common.netaddr import free_port  # torch.distributed: not at import

        port = free_port()
        return cls(command_for_port(port), f"http://{host}:{port}", log_file, command_for_port=command_for_port,
                   **options)

    def launch(self) -> "ManagedServer":
        """Start the process (not waiting for it: `ready` does; several servers start at once)."""
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_file, "ab")
        self.log_start = log.tell()  # this start's lines begin here (a retry appends to the same log)
        # Its own TMPDIR, removed by `stop`: a server stopped by signal runs no exit handler, and SGLang
        # left its IPC socket files and wandb's directories in /tmp at every start. A short path: the
        # IPC sockets' names must fit in 107 bytes (`server_tmp_root`).
        remove_orphaned_tmp_dirs()
        self.tmp_dir = Path(tempfile.mkdtemp(prefix=f"{SERVER_TMP_PREFIX}{os.getpid()}-", dir=server_tmp_root()))
        env = {**(os.environ if self.env is None else self.env), "TMPDIR": str(self.tmp_dir)}
        self.process = start_redacted(self.cmd, log, self.secrets, env, new_session=True)
        self._group_killed = False
        if not self.secrets:
            log.close()  # the child holds its own copy of the descriptor
        return self

    def ready(self, attempts: int = 2) -> "ManagedServer":
        """Wait for /health. A start that dies by a signal (SGLang's launcher SIGKILLs its own
        tree when a worker fails to initialise) or on a port taken in the meantime is retried
        once: both are races with other processes on the host, not bad input. A port taken is
        taken for good by whoever holds it (another server that drew the same free port): the
        retry goes to a new port when `command_for_port` can say the command for it."""
        for attempt in range(attempts):
            try:
                self.wait_healthy()
                return self
            except ServerStartError as exc:
                self.stop()
                if attempt + 1 == attempts or not exc.transient:
                    raise
                if exc.port_taken and self.command_for_port is not None:
                    from gspo_mcore.common.netaddr import free_port  # torch.distributed: not at import

                    port = free_port()
                    self.cmd = self.command_for_port(port)
                    self.url = urlunsplit(urlsplit(self.url)._replace(netloc=f"{urlsplit(self.url).hostname}:{port}"))
                print(f"{exc}; starting it again" + (f" at {self.url}" if exc.port_taken else ""), file=sys.stderr,
                      flush=True)
                self.launch()
        return self

    def start(self) -> "ManagedServer":
        return self.launch().ready()

    def healthy(self) -> bool:
        try:
            get_json(f"{self.url}/health", timeout_s=5)  # SGLang answers 200 with an empty body
            return True
        except HTTPRequestError:
            return False

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                code, reason = self.process.returncode, last_error_line(self.log_file)
                raise ServerStartError(
                    f"server {self.url} exited with code {code} while starting"
                    + (f" ({reason})" if reason else "") + f"; see {self.log_file}",
                    transient=code < 0, port_taken="address already in use" in reason.lower())
            if self.healthy():
                return
            # The port taken between free_port() and the server's bind: SGLang logs it and keeps its
            # scheduler running (seen under a loaded test suite), so it never exits nor answers.
            taken = [ln.strip() for ln in log_tail(self.log_file, 8192, self.log_start)
                     if "address already in use" in ln.lower()]
            if taken:
                raise ServerStartError(f"server {self.url} could not bind its port ({taken[-1][:300]}); "
                                       f"see {self.log_file}", port_taken=True)
            time.sleep(0.5)
        self.stop()
        raise InputError(f"server {self.url} not healthy after {self.startup_timeout_s:.0f} s; see {self.log_file}")

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop it and every process of its group (`_stop`), and remove its TMPDIR."""
        try:
            self._stop(grace_s)
        finally:
            if self.tmp_dir is not None:
                shutil.rmtree(self.tmp_dir, ignore_errors=True)
                self.tmp_dir = None

    def _stop(self, grace_s: float) -> None:
        """SIGTERM to the leader, which stops its own workers (SIGTERM to the whole group made
        SGLang's launcher see its scheduler die, take it for a crash and wait 5 s for diagnostics);
        then SIGKILL to whatever of the group is left."""
        if self.process is not None and self.process.poll() is None and not _STOPPING_AT_ONCE:
            self.process.terminate()
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        if self.process is not None and not self._group_killed:
            try:  # workers that outlived the leader share its process group
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            # once: a second stop must not signal the group id again, which the kernel hands to a
            # new process (a sandbox's bwrap, another server) once the old group is empty
            self._group_killed = True
            self.process.wait()

    def __enter__(self) -> "ManagedServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def start_worker(argv: list[str], env: dict) -> subprocess.Popen:
    """A pipe-driven worker (reward, tool): one JSON line per request on stdin, one per reply on
    stdout. In its own session: the terminal's Ctrl-C goes to the process group of the command
    the user ran, and a worker there would die of it with a traceback in the middle of the
    trainer's stop message; the trainer stops its workers itself (closing their pipes or killing
    them), and they follow it when it dies (die_with_parent, exit_with_parent)."""
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, env=env,
                            start_new_session=True,
                            # Tied to the starting thread by the kernel; the worker also watches for its parent.
                            preexec_fn=die_with_parent if in_main_thread() else None)


def read_json_reply(process: subprocess.Popen, timeout_s: float):
    """A worker's next one-line JSON reply on its stdout, or None if none came within `timeout_s`
    or the worker died (reward and tool workers: one reply per request, never two lines waiting)."""
    if not select.select([process.stdout], [], [], max(0.0, timeout_s))[0]:
        return None
    line = process.stdout.readline()
    return json.loads(line) if line else None


def kill_worker(process: subprocess.Popen) -> None:
    """Kill a pipe-driven worker, reap it, close its pipes."""
    process.kill()
    process.wait()
    for pipe in (process.stdin, process.stdout):
        try:
            pipe.close()
        except (OSError, ValueError):  # ValueError: a thread was writing to it (a tool call a close overtook)
            pass
