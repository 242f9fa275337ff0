"""How a sandbox starts: bubblewrap's command line, the per-slot uid, the slot's cgroup, and the
refusal where bubblewrap cannot run.

The boundary (bwrap 0.8, Debian's `bubblewrap`): new PID, network, IPC, UTS and cgroup
namespaces; a read-only root filesystem that holds only the interpreter's directories (/usr, so
the C++ compiler too; the site-packages / dist-packages directories in them masked by empty
ones), the stated packages (PACKAGES, at /sandbox/packages), the harness file, a fresh /proc, a
read-only /dev of five device nodes (null, zero, full, random, urandom: no devpts, so no PTY of
the host's shared pool) and a small private tmpfs at /tmp; an empty environment (the harness
gives its tests THREAD_ENV); `--new-session` (no controlling terminal to push keystrokes into);
`--die-with-parent`; the seccomp filter of gspo_mcore.sandbox.seccomp for everything inside.
One sandbox judges one program: nothing of it (files, IPC, processes, PIDs) is seen by the next.

Started by root (CI, most containers), bwrap makes no user namespace: the harness keeps only
CAP_SETUID, CAP_SETGID and CAP_KILL and drops each test to the slot's own non-root uid, which
the kernel holds to RLIMIT_NPROC (it never does for uid 0, even in a user namespace) and which
cannot signal or inspect the harness; the slot's cgroup (gspo_mcore.sandbox.cgroup) bounds the
sandbox's memory and processes as a whole. Started by another user, bwrap makes a user namespace
(unprivileged user namespaces must be enabled) and the program keeps that user's uid there: the
harness then sets PR_SET_DUMPABLE 0 (its /proc fds and memory closed to the tests), and a program
that kills the harness is an infrastructure error, never a pass."""

from __future__ import annotations

import fcntl
import functools
import glob
import hashlib
import importlib.metadata
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

from gspo_mcore.common.errors import EngineError
from gspo_mcore.sandbox.cgroup import SlotCgroup
from gspo_mcore.sandbox.seccomp import SeccompUnavailable, filter_bpf

HARNESS = Path(__file__).with_name("harness.py")
INSIDE_HARNESS = "/sandbox/harness.py"
SLOT_DIR = Path("/tmp/gspo-sandbox-slots")  # one lock file per slot uid, shared by root's processes of the host
UNSAFE_VARIABLE = "GSPO_SANDBOX_UNSAFE_NO_ISOLATION"
DEVICES = ("null", "zero", "full", "random", "urandom")
# The packages a program (a solution, the Python tool's code) may import beyond the standard
# library, by distribution name, with what they need (sympy: mpmath). Each is this host's installed
# copy (the Python that starts the sandbox: the venv's, where setup.py's numpy and torch's sympy
# are), bound read-only at INSIDE_PACKAGES file by top-level entry; nothing else of any
# site-packages is inside. docs/13-code-rl.md, "The sandbox", states the set.
PACKAGES = ("numpy", "sympy", "mpmath")
INSIDE_PACKAGES = "/sandbox/packages"
# Thread pools that start at import (numpy's OpenBLAS: one thread per core, past a test's process
# limit on a big node) held to one thread: a test's CPU time counts every thread anyway.
THREAD_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
# C++: GNU C++17 as contest judges compile it (Codeforces: -O2); the harness puts the source file
# in place of `-` and adds `-o` (the sandbox's /tmp: harness.compile_program). No -pipe: a pipe
# between cc1plus and as is one more stream an include could wait on. Errors stop at 20: a
# template bomb's messages are not read.
CPP_FLAGS = ("-x", "c++", "-std=gnu++17", "-O2", "-fmax-errors=20", "-")
# The compiler's environment (with THREAD_ENV): it finds cc1plus by its own path, as and ld on PATH.
COMPILE_ENV = {"PATH": "/usr/bin:/bin", "TMPDIR": "/tmp", "LC_ALL": "C"}
# The contest header, precompiled once per host for CPP_FLAGS (cpp_pch): g++ takes
# <dir>/bits/stdc++.h.gch for `#include <bits/stdc++.h>` when <dir> is an -I directory (and
# ignores it, compiling the header, should it not match the flags): 0.4 s of CPU instead of 2.
PCH_HEADER = "bits/stdc++.h"
INSIDE_PCH = "/sandbox/pch"
_pch_built: Path | None = None  # cpp_pch's, once this process has one: bound into every sandbox started after
_pch_warned = False


class SandboxUnavailable(EngineError):
    """The sandbox cannot start on this machine: the message says why and what to do."""


class SandboxError(EngineError):
    """An infrastructure error: never a verdict on the program."""


@dataclass(frozen=True)
class SandboxSettings:
    slot_uid_base: int = 61000
    """Slot i runs its programs as uid slot_uid_base + i (root only): uids no file belongs to."""
    slots: int = 256
    """How many sandboxes may run at once on this host (each holds one slot uid). A reward
    worker holds up to four: the program's, a started spare of each kind (stdin, functional) and
    a problem's checker; 256 leaves room for 64 workers."""
    tmpfs_bytes: int = 64 * 1024 * 1024
    unsafe_no_isolation: bool = False
    """Rlimits only, no bubblewrap or seccomp: the program reads what the trainer's user reads and
    reaches the network. For a machine where bwrap cannot run and the programs are trusted."""

    @classmethod
    def from_env(cls) -> "SandboxSettings":
        return cls(unsafe_no_isolation=os.environ.get(UNSAFE_VARIABLE, "") == "1")


def _slot_dir() -> Path:
    """SLOT_DIR, made ours: a real directory (lstat: not a link another user planted in the
    shared /tmp), owned by us, mode 0700; one line naming it otherwise."""
    try:
        SLOT_DIR.mkdir(mode=0o700)
    except FileExistsError:
        pass
    info = os.lstat(SLOT_DIR)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or stat.S_IMODE(info.st_mode) & 0o077:
        raise SandboxUnavailable(f"sandbox: {SLOT_DIR} is not a directory of uid {os.geteuid()} with mode 0700 "
                                 "(a link or another user's directory in the shared /tmp): remove it")
    return SLOT_DIR


class Slot:
    """A slot uid held (flock on its lock file) until `release`, across processes and threads,
    with the slot's cgroup where the host has one (None: gspo_mcore.sandbox.cgroup says why)."""

    def __init__(self, settings: SandboxSettings):
        directory = _slot_dir()
        for index in range(settings.slots):
            fd = os.open(directory / f"{index}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.fd, self.index, self.uid = fd, index, settings.slot_uid_base + index
            try:
                self.cgroup = SlotCgroup.create(index)
            except BaseException:
                self.release()
                raise
            return
        raise SandboxError(f"sandbox: all {settings.slots} slots are in use on this host (SandboxSettings.slots)")

    def release(self) -> None:
        if getattr(self, "cgroup", None) is not None:
            self.cgroup.remove()
            self.cgroup = None
        if self.fd >= 0:
            os.close(self.fd)  # drops the lock
            self.fd = -1


def interpreter() -> tuple[str, str]:
    """(the base Python's executable, its prefix): the harness runs on the interpreter without a
    virtual environment's packages (it needs the standard library only; a program gets PACKAGES)."""
    executable = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    return executable, os.path.realpath(sys.base_prefix)


def _root_entries() -> list[str]:
    """/usr read-only, and the top-level links and directories the loader needs (/lib64 on
    x86_64), as this host lays them out."""
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = Path("/") / name
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            args += ["--ro-bind", str(path), str(path)]
    return args


@functools.lru_cache(maxsize=1)
def package_paths() -> tuple[Path, ...]:
    """The top-level files and directories of PACKAGES' installed distributions (numpy: numpy/ and
    numpy.libs/, its vendored OpenBLAS), from their RECORD; a package missing here is said once on
    stderr (a program importing it fails as it would without it)."""
    found, missing = [], []
    for name in PACKAGES:
        try:
            distribution = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
            continue
        tops = sorted({file.parts[0] for file in distribution.files or () if file.parts[0] not in ("..", "__pycache__")
                       and not file.parts[0].endswith(".dist-info")})
        paths = [Path(distribution.locate_file(top)) for top in tops]
        found += [path for path in paths if path.exists()]
        if not paths:
            missing.append(name)
    if missing:
        print(f"WARNING: sandbox: {', '.join(missing)} not installed in {sys.executable}: programs that import "
              f"{'it' if len(missing) == 1 else 'them'} fail (pip install {' '.join(missing)})", file=sys.stderr,
              flush=True)
    return tuple(found)


def inside_path(settings: SandboxSettings) -> list[str]:
    """Where the packages are for the harness's sys.path: INSIDE_PACKAGES in the sandbox; in the
    unsafe mode the directories holding them (with everything else installed there)."""
    if settings.unsafe_no_isolation:
        return sorted({str(path.parent) for path in package_paths()})
    return [INSIDE_PACKAGES]


@functools.lru_cache(maxsize=1)
def _site_dirs(prefix: str) -> tuple[str, ...]:
    """The installed-package directories inside the bound trees (/usr, the interpreter's prefix):
    masked by empty read-only ones, so that `sys.path.append` does not reach the host's packages."""
    patterns = ("/usr/lib/python3*/*-packages", "/usr/local/lib/python3*/*-packages", "/usr/lib/python3/dist-packages",
                f"{prefix}/lib/python3*/site-packages", f"{prefix}/local/lib/python3*/*-packages")
    return tuple(sorted({os.path.realpath(path) for pattern in patterns for path in glob.glob(pattern)
                         if os.path.isdir(path) and Path(path).name in ("site-packages", "dist-packages")}))


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gspo-mcore" / "pch"


@functools.lru_cache(maxsize=4)
def _pch_place(compiler: str) -> tuple[Path, str]:
    """(where cpp_pch keeps the header for `compiler`: the user's cache, keyed by the compiler,
    CPP_FLAGS and the header; the header, which `g++ -M` finds: ~50 ms, once per process)."""
    found = subprocess.run([compiler, "-x", "c++", "-std=gnu++17", "-M", "-"], input=f"#include <{PCH_HEADER}>\n",
                           capture_output=True, text=True, timeout=60, env=COMPILE_ENV)
    header = next(word for word in found.stdout.split() if word.endswith("/" + PCH_HEADER))
    key = hashlib.sha1(repr((compiler, os.stat(compiler).st_mtime_ns, CPP_FLAGS, header,
                             os.stat(header).st_mtime_ns)).encode()).hexdigest()[:16]
    return _cache_dir() / key, header


def cpp_pch(compiler: str, build: bool = False) -> Path | None:
    """The directory holding bits/stdc++.h.gch for `compiler` and CPP_FLAGS, or None; `build`: made
    now where missing (outside the sandbox: the system's own header, ~5 s of CPU and 100 MB once
    per host, under a lock shared by this host's processes; the pre-flight and the scoring command
    build it, a reward call never waits for it). None where it cannot be built (said once on
    stderr): each program then compiles the header."""
    global _pch_built, _pch_warned
    if _pch_built is not None:
        return _pch_built
    try:
        directory, header = _pch_place(compiler)
        target = directory / (PCH_HEADER + ".gch")
        if not target.exists() and build:
            target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
            with open(directory / "lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it
                if not target.exists():
                    _build_pch(compiler, header, target)
        if not target.exists():
            return None
    except (OSError, StopIteration, subprocess.SubprocessError) as err:
        if not _pch_warned:
            print(f"WARNING: sandbox: no precompiled {PCH_HEADER} ({type(err).__name__}: {str(err)[:200]}): each "
                  "C++ program that includes it compiles it (~2 s of CPU)", file=sys.stderr, flush=True)
            _pch_warned = True
        return None
    _pch_built = directory
    return directory


def _build_pch(compiler: str, header: str, target: Path) -> None:
    fd, partial = tempfile.mkstemp(dir=target.parent, suffix=".partial")
    os.close(fd)
    try:
        flags = [flag for flag in CPP_FLAGS if flag not in ("-x", "c++", "-")]
        subprocess.run([compiler, "-x", "c++-header", *flags, header, "-o", partial], check=True,
                       capture_output=True, timeout=300, env=COMPILE_ENV)
        os.chmod(partial, 0o644)  # mkstemp's 0600: the slot uids read it
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def cpp_compiler(settings: SandboxSettings) -> str:
    """g++ (inside the sandbox under /usr with its headers, cc1plus and binutils' as / ld);
    SandboxUnavailable in one line where there is none."""
    compiler = shutil.which("g++")
    missing = [tool for tool in ("as", "ld") if shutil.which(tool) is None]
    if compiler is None or missing:
        said = "g++ is not installed" if compiler is None else f"binutils' {' and '.join(missing)} missing"
        raise SandboxUnavailable(f"sandbox: C++ answers are compiled with g++ inside the sandbox, and {said} "
                                 "(Debian/Ubuntu: apt-get install g++; `make sandbox`), or judge Python only "
                                 "(reward.code.languages: [python])")
    compiler = os.path.realpath(compiler)
    if not settings.unsafe_no_isolation and not compiler.startswith("/usr/"):
        raise SandboxUnavailable(f"sandbox: g++ is {compiler}, outside /usr, the only tree the sandbox holds: "
                                 "install Debian's g++ (apt-get install g++), or judge Python only "
                                 "(reward.code.languages: [python])")
    return compiler


def cpp_command(settings: SandboxSettings) -> list[str]:
    """The compile command for a C++ program, with the precompiled header where this host has it."""
    compiler = cpp_compiler(settings)
    pch = cpp_pch(compiler)
    if pch is None:
        return [compiler, *CPP_FLAGS]
    # the unsafe mode reads the host's cache where it is; the sandbox has it at INSIDE_PCH
    return [compiler, f"-I{pch if settings.unsafe_no_isolation else INSIDE_PCH}", *CPP_FLAGS]


def _traversable_parents(path: str) -> list[str]:
    """Its ancestors made world-traversable inside (bwrap copies a parent's mode: under /root,
    0700, and the slot uid could not reach the interpreter's modules)."""
    args, parts = [], Path(path).parts[1:-1]
    for depth in range(1, len(parts) + 1):
        args += ["--perms", "0755", "--dir", "/" + "/".join(parts[:depth])]
    return args


def bwrap_argv(seccomp_fd: int, settings: SandboxSettings) -> list[str]:
    executable, prefix = interpreter()
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable("sandbox: bubblewrap is not installed (Debian/Ubuntu: apt-get install bubblewrap; "
                                 f"`make sandbox`), or set {UNSAFE_VARIABLE}=1 to run untrusted code "
                                 "with rlimits only (unsafe)")
    args = [bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--hostname", "sandbox", "--die-with-parent", "--new-session", "--clearenv"]
    if os.geteuid() == 0:  # no user namespace: the harness switches each test to the slot's uid
        args += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_KILL"]
    else:
        args += ["--unshare-user", "--disable-userns"]
    args += _root_entries()
    stdlib = os.path.realpath(sysconfig.get_paths()["stdlib"])
    bound = ["/usr"]
    for path in (prefix, stdlib):  # pyenv, conda, a source build: bind it where it is
        if not any(path == b or path.startswith(b + "/") for b in bound):
            args += _traversable_parents(path) + ["--ro-bind", path, path]
            bound.append(path)
    for site in _site_dirs(prefix):  # read-only: the root's remount below does not reach a mount on top
        args += ["--perms", "0555", "--tmpfs", site, "--remount-ro", site]
    # made 0755 here: a directory bwrap makes for a bind takes the mode of the source's parent
    args += ["--perms", "0755", "--dir", "/sandbox", "--perms", "0755", "--dir", INSIDE_PACKAGES,
             "--ro-bind", str(HARNESS), INSIDE_HARNESS]
    for path in package_paths():
        args += ["--ro-bind", str(path), f"{INSIDE_PACKAGES}/{path.name}"]
    if _pch_built is not None:  # a sandbox started before this process judged C++ compiles without it
        args += ["--ro-bind", str(_pch_built), INSIDE_PCH]
    args += ["--proc", "/proc", "--perms", "0755", "--dir", "/dev"]
    for device in DEVICES:  # bwrap's --dev would mount a devpts: PTYs count against the host's kernel.pty.max
        args += ["--dev-bind", f"/dev/{device}", f"/dev/{device}"]
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        args += ["--symlink", target, f"/dev/{name}"]
    args += ["--perms", "1777", "--size", str(settings.tmpfs_bytes), "--tmpfs", "/tmp",
             "--remount-ro", "/",  # the root tmpfs (/dev's directory in it): the user's own in a user namespace
             "--chdir", "/tmp", "--seccomp", str(seccomp_fd), "--", executable, "-I", "-S", INSIDE_HARNESS]
    return args


def unsafe_argv() -> list[str]:
    executable, _ = interpreter()
    return [executable, "-I", "-S", str(HARNESS)]


_warned = False


def start_harness(settings: SandboxSettings, cgroup: SlotCgroup | None = None) -> subprocess.Popen:
    """The harness process, in its own process group (the host kills the group), pipes on its
    stdin / stdout / stderr; in `cgroup` from its first instruction (bwrap and all it starts)."""
    global _warned
    popen = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    if cgroup is not None:
        # Joined between fork and exec, so that nothing of the sandbox runs outside it (Python
        # 3.11's subprocess has no CLONE_INTO_CGROUP); os.write of bytes: no lock taken in the child.
        fds, write = cgroup.procs_fds, os.write
        popen["preexec_fn"] = lambda: [write(fd, b"0") for fd in fds]
    if settings.unsafe_no_isolation:
        if not _warned:  # on stderr, once per process: a warnings filter must not hide it
            print(f"WARNING: sandbox: {UNSAFE_VARIABLE}=1: untrusted programs run with rlimits only, no bubblewrap "
                  "or seccomp: they can read this user's files and reach the network", file=sys.stderr, flush=True)
            _warned = True
        return subprocess.Popen(unsafe_argv(), env={}, cwd="/tmp", **popen)
    try:
        bpf = filter_bpf()
    except SeccompUnavailable as err:
        raise SandboxUnavailable(f"sandbox: {err}") from None
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, bpf)  # a few hundred bytes: fits the pipe's buffer
        os.close(write_end)
        write_end = -1
        return subprocess.Popen(bwrap_argv(read_end, settings), pass_fds=(read_end,), **popen)
    finally:
        os.close(read_end)
        if write_end >= 0:
            os.close(write_end)


def explain_failure(stderr: str) -> str:
    """One line for a bwrap that did not start: what it said and what to enable."""
    said = stderr.strip().splitlines()[-1] if stderr.strip() else "no message"
    hint = ""
    if "namespace" in said or "Operation not permitted" in said or "clone" in said:
        hint = ("; enable unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1, "
                "user.max_user_namespaces > 0, or an AppArmor profile for bwrap) or run the reward workers as root")
    return (f"sandbox: bubblewrap could not start ({said}){hint}; or set {UNSAFE_VARIABLE}=1 for rlimits "
            "only (unsafe)")
