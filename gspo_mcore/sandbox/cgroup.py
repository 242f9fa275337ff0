"""A sandbox's cgroup: its memory and its processes bounded as a whole.

RLIMIT_AS bounds one process (32 processes may each map the limit), and memory that no process
maps is not counted by it at all (a tmpfs's files, kernel memory). A cgroup counts all of it:
every process of the sandbox (bwrap, the harness, each test and what it forks) is in the slot's
cgroup from its first instruction (launch.start_harness joins it between fork and exec), with
`memory` (its pages, its tmpfs's pages, the kernel memory it causes, no swap) and `pids` bounded.
The memory cgroup's OOM killer picks a test process (each test raises its oom_score_adj to
1000), never the harness: the host reads the kill from the cgroup's counters and says `memory`.

cgroup v2 where this process's cgroup delegates the memory and pids controllers; else cgroup v1's
memory and pids hierarchies where they are mounted and writable (root). Each is nested under this
process's own cgroup, so every limit set on the trainer still applies. Elsewhere (not root, no
delegated subtree) there is none: `unavailable()` says why, once on stderr, and the sandbox keeps
its per-process rlimits, the tmpfs's size and the uid's process count."""

from __future__ import annotations

import errno
import itertools
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

PARENT = "gspo-sandbox"  # the slots' cgroups, under this process's own


# v1 hierarchies a slot's cgroup is made in: memory and pids bound it; where mounted, cpuacct
# counts its CPU, every process of it, waited for or not (SlotCgroup.cpu_seconds), and cpu bounds
# it to SANDBOX_CPUS (a candidate's spinning processes cannot starve a checker or a group-mate).
V1_CONTROLLERS = ("memory", "pids", "cpuacct", "cpu")
SANDBOX_CPUS = 1.0
CPU_PERIOD_US = 100_000


def _mounts() -> dict[str, Path]:
    """{"unified" | controller: mount point} from /proc/self/mountinfo."""
    found: dict[str, Path] = {}
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        head, _, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if len(fields) < 5 or len(rest) < 3:
            continue
        if rest[0] == "cgroup2":
            found.setdefault("unified", Path(fields[4]))
        elif rest[0] == "cgroup":
            for option in rest[2].split(","):
                if option in V1_CONTROLLERS:
                    found.setdefault(option, Path(fields[4]))
    return found


def _own_paths() -> dict[str, str]:
    """{"unified" | controller: this process's cgroup path} from /proc/self/cgroup."""
    paths: dict[str, str] = {}
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return paths
    for line in lines:
        number, controllers, path = line.split(":", 2)
        if number == "0" and controllers == "":
            paths["unified"] = path
        for controller in controllers.split(","):
            if controller in V1_CONTROLLERS:
                paths[controller] = path
    return paths


def _write(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


@dataclass(frozen=True)
class _Layout:
    version: int  # 2, or 1 (separate memory and pids hierarchies)
    parents: tuple[Path, ...]  # where the slots' cgroups go: one (v2) or one a v1 controller of `controllers`
    controllers: tuple[str, ...] = ("memory", "pids")  # v1: each parent's; v2: ("unified",)


def _find() -> _Layout | str:
    """Where this host lets us make cgroups, or why not."""
    mounts, own = _mounts(), _own_paths()
    reasons = []
    if "unified" in mounts and "unified" in own:
        base = mounts["unified"] / own["unified"].lstrip("/")
        try:
            controllers = (base / "cgroup.controllers").read_text().split()
        except OSError as err:
            controllers = []
            reasons.append(f"v2: {base}: {err.strerror}")
        if {"memory", "pids"} <= set(controllers):
            parent = base / PARENT
            try:
                # v2's "no internal processes" rule: a cgroup holding processes (ours, unless it is
                # the root or a delegated subtree already hands them down) cannot enable controllers
                # for its children; not tested on the development host, which has cgroup v1
                _write(base / "cgroup.subtree_control", "+memory +pids")
                parent.mkdir(exist_ok=True)
                _write(parent / "cgroup.subtree_control", "+memory +pids")
                if "cpu" in controllers:  # the CPU bound where the cpu controller can be had
                    try:
                        _write(base / "cgroup.subtree_control", "+cpu")
                        _write(parent / "cgroup.subtree_control", "+cpu")
                    except OSError:
                        pass
                return _Layout(2, (parent,), ("unified",))
            except OSError as err:
                reasons.append(f"v2: {err.filename or base}: {err.strerror} (run the reward workers in a leaf "
                               "of a delegated subtree, e.g. systemd's Delegate=yes)")
        elif not reasons:
            reasons.append(f"v2: {base} has no memory and pids controllers ({' '.join(controllers) or 'none'})")
    if "memory" in mounts and "pids" in mounts:
        controllers = tuple(c for c in V1_CONTROLLERS if c in mounts)
        parents = tuple(mounts[c] / own.get(c, "/").lstrip("/") / PARENT for c in controllers)
        try:
            for parent in parents:
                parent.mkdir(exist_ok=True)
            return _Layout(1, parents, controllers)
        except OSError as err:
            reasons.append(f"v1: {err.filename}: {err.strerror}")
    else:
        reasons.append("v1: no memory and pids hierarchies mounted")
    return "; ".join(reasons)


_layout: _Layout | str | None = None
_warned = False
_made = itertools.count()  # this process's cgroups, for their names
_left: list[Path] = []  # cgroups still busy when their sandbox was reaped


def layout(root: bool = True) -> _Layout | None:
    """This host's layout, found once per process; None (and one line on stderr) where none
    (`root` False: the sandboxes of a user that is not root have no slot and no cgroup)."""
    global _layout, _warned
    if _layout is None:
        _layout = _find() if root else "started by a user that is not root"
        if not isinstance(_layout, str):
            _sweep(_layout)
    if isinstance(_layout, str):
        if not _warned:
            print(f"sandbox: no cgroup for the sandboxes ({_layout}): memory is bounded per process only "
                  "(RLIMIT_AS) and the tmpfs by its size", file=sys.stderr, flush=True)
            _warned = True
        return None
    return _layout


def _sweep(found: _Layout) -> None:
    """The cgroups of processes that died without their exit (a reward worker killed on a
    timeout), removed: named slot-<slot>-<pid>-<count>, empty once their sandbox died."""
    for parent in found.parents:
        for child in parent.iterdir():
            parts = child.name.split("-")
            if len(parts) == 4 and parts[0] == "slot" and parts[2].isdigit() and not Path(f"/proc/{parts[2]}").exists():
                try:
                    child.rmdir()
                except OSError:
                    pass


def remove_parents() -> None:
    """At exit (gspo_mcore.sandbox.session's): our parent directories, where no other process's
    slots remain in them (a cgroup left behind would keep the trainer's own from being removed)."""
    for directory in _left:
        try:
            directory.rmdir()
        except OSError:
            pass
    if _layout is None or isinstance(_layout, str):
        return
    for parent in _layout.parents:
        try:
            parent.rmdir()
        except OSError:
            pass


def unavailable() -> str | None:
    """Why the sandboxes have no cgroup here; None when they have one."""
    layout()
    return _layout if isinstance(_layout, str) else None


def _make_slot(found: _Layout, directory: Path) -> None:
    """`directory` made, and its parent again where another process's exit removed it while it
    was empty (remove_parents: the parents are shared by every process of this cgroup, e.g.
    pytest's workers or the reward workers); the parent can go again before the child is made."""
    for attempt in range(5):
        try:
            directory.mkdir()
            return
        except FileNotFoundError:
            if attempt == 4:
                raise
            directory.parent.mkdir(exist_ok=True)
            if found.version == 2:
                _write(directory.parent / "cgroup.subtree_control", "+memory +pids")


class SlotCgroup:
    """One sandbox's cgroup (v2: one directory; v1: one in the memory and one in the pids
    hierarchy), made when its slot is taken and removed when it is released. Named by slot,
    process and count: never one that another sandbox was using, or one left with its limits."""

    def __init__(self, version: int, directories: tuple[Path, ...], controllers: tuple[str, ...] = ("memory", "pids")):
        self.version, self.directories = version, directories
        self.by_controller = dict(zip(controllers, directories))
        self.procs_fds = [os.open(d / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC) for d in directories]

    @classmethod
    def create(cls, slot: int) -> "SlotCgroup | None":
        found = layout()
        if found is None:
            return None
        name = f"slot-{slot}-{os.getpid()}-{next(_made)}"
        directories = tuple(parent / name for parent in found.parents)
        made = []
        try:
            for directory in directories:
                _make_slot(found, directory)
                made.append(directory)
        except BaseException:
            for directory in made:
                try:
                    directory.rmdir()
                except OSError:
                    pass
            raise
        return cls(found.version, directories, found.controllers)

    def set_limits(self, memory_bytes: int, processes: int) -> None:
        if self.version == 2:
            directory = self.directories[0]
            _write(directory / "memory.max", str(memory_bytes))
            _write(directory / "memory.swap.max", "0")
            _write(directory / "pids.max", str(processes))
            if (directory / "cpu.max").exists():
                _write(directory / "cpu.max", f"{int(SANDBOX_CPUS * CPU_PERIOD_US)} {CPU_PERIOD_US}")
        else:
            memory, pids = self.by_controller["memory"], self.by_controller["pids"]
            if "cpu" in self.by_controller:
                cpu = self.by_controller["cpu"]
                _write(cpu / "cpu.cfs_period_us", str(CPU_PERIOD_US))
                _write(cpu / "cpu.cfs_quota_us", str(int(SANDBOX_CPUS * CPU_PERIOD_US)))
            _write(memory / "memory.limit_in_bytes", str(memory_bytes))
            if (memory / "memory.memsw.limit_in_bytes").exists():  # swap accounting on: no swap either
                try:
                    _write(memory / "memory.memsw.limit_in_bytes", str(memory_bytes))
                except OSError:
                    pass
            _write(pids / "pids.max", str(processes))

    def cpu_seconds(self) -> float | None:
        """The CPU time of every process that ran in the cgroup since it was made (v2 cpu.stat's
        usage_usec, present without the cpu controller; v1 cpuacct.usage), None where not counted."""
        try:
            if self.version == 2:
                for line in (self.directories[0] / "cpu.stat").read_text().splitlines():
                    key, _, value = line.partition(" ")
                    if key == "usage_usec":
                        return int(value) / 1e6
                return None
            if "cpuacct" in self.by_controller:
                return int((self.by_controller["cpuacct"] / "cpuacct.usage").read_text()) / 1e9
        except (OSError, ValueError):
            return None
        return None

    def oom_kills(self) -> int:
        """How many processes the memory limit killed since the cgroup was made."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            text = (self.directories[0] / name).read_text()
        except OSError:
            return 0
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def remove(self) -> None:
        """Closed, and removed once its processes are gone (a killed sandbox's take a moment to
        be reaped); one still busy after 0.5 s is tried again at exit."""
        for fd in self.procs_fds:
            os.close(fd)
        self.procs_fds = []
        deadline = time.monotonic() + 0.5
        for directory in self.directories:
            while True:
                try:
                    directory.rmdir()
                    break
                except OSError as err:
                    if err.errno != errno.EBUSY or time.monotonic() > deadline:
                        _left.append(directory)
                        break
                    time.sleep(0.002)
