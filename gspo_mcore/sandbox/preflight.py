"""The sandbox's pre-flight: at a run's start-up, before any server or model, whether bubblewrap
can run here, refused in one line that names what is missing and how to grant it. Without it the
refusal came from the first reward call, after the model was built and the servers started.

What bubblewrap needs (gspo_mcore.sandbox.launch's command line), each seen on this project's
machines (Debian 12, kernel 6.x, bwrap 0.8.0) with the capability taken away:
- started by root (most GPU images), no user namespace: CAP_SYS_ADMIN to make its PID / network
  / mount namespaces ("bwrap: Creating new namespace failed: Operation not permitted" without);
  no seccomp filter that denies `pivot_root` (Docker's default profile has it in none of its
  allow lists, not even with CAP_SYS_ADMIN: "bwrap: pivot_root: Operation not permitted"); no
  AppArmor profile that denies `mount` (Docker's `docker-default` does); and the slot uids it
  drops each test to (SandboxSettings.slot_uid_base, .slots) mapped, which a user namespace's
  "root" (pyxis/enroot `--container-remap-root`, rootless podman) does not have;
- started by another user: unprivileged user namespaces, and a /proc the kernel lets a user
  namespace mount again: none of its files masked by another mount (Docker's default masks
  /proc/kcore, /proc/acpi, ...; "bwrap: Can't mount proc on /newroot/proc" then). Root needs
  no unmasked /proc: the kernel checks that only for mounts made inside a user namespace
  (fs/namespace.c, mount_too_revealing).

`preflight` refuses at once on what certainly stops bubblewrap; otherwise it runs one trivial
program through the real sandbox (`check_sandbox`) and, where that fails, names what it found
here that may be the cause. DOCKER_FLAGS is the one list of `docker run` flags the docs give
(tests/test_sandbox_preflight.py holds the docs to it)."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from gspo_mcore.sandbox import UNSAFE_VARIABLE, SandboxSettings, SandboxUnavailable, check_languages, check_sandbox

# `docker run` flags for bubblewrap started by root in the container (the image's user):
# (flag, value, why). systempaths=unconfined is not among them: root does not need it, and it
# would open /proc/sys and /proc/sysrq-trigger to the container's root.
DOCKER_FLAGS = (
    ("--cap-add", "SYS_ADMIN", "root makes bwrap's namespaces with CAP_SYS_ADMIN, which Docker drops"),
    ("--security-opt", "seccomp=unconfined", "Docker's default seccomp profile denies pivot_root"),
    ("--security-opt", "apparmor=unconfined", "Docker's AppArmor profile docker-default denies mount"),
)
# Started by a user that is not root inside the container: a user namespace instead of
# CAP_SYS_ADMIN (the default seccomp profile denies unshare without it), and /proc unmasked.
DOCKER_FLAGS_NOT_ROOT = (
    ("--security-opt", "seccomp=unconfined", "Docker's default seccomp profile denies unshare without CAP_SYS_ADMIN"),
    ("--security-opt", "apparmor=unconfined", "Docker's AppArmor profile docker-default denies mount"),
    ("--security-opt", "systempaths=unconfined", "a user namespace cannot mount a /proc whose files Docker masks"),
)
CAP_SYS_ADMIN = 21  # linux/capability.h


def docker_flags(flags=DOCKER_FLAGS) -> str:
    return " ".join(f"{flag} {value}" for flag, value, _ in flags)


@dataclass(frozen=True)
class Host:
    """What the pre-flight reads of this process and machine (`read_host`); tests build their own."""

    euid: int
    bwrap: str | None  # its path on PATH
    effective_caps: int  # /proc/self/status CapEff
    seccomp_mode: int  # 0 none, 2 a filter (Docker's default profile, pyxis's)
    security_label: str  # AppArmor profile or SELinux context; "" when neither
    uid_map: tuple[tuple[int, int, int], ...]  # (inside, outside, count) rows of /proc/self/uid_map
    gid_map: tuple[tuple[int, int, int], ...]
    proc_masks: tuple[str, ...] = ()  # mount points below /proc (Docker's masked paths)
    in_container: bool = False
    sysctls: dict[str, int] = field(default_factory=dict)  # the user-namespace switches this kernel has


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _status_field(status: str, name: str) -> str:
    for line in status.splitlines():
        if line.startswith(name + ":"):
            return line.split(":", 1)[1].strip()
    return ""


def _id_map(text: str) -> tuple[tuple[int, int, int], ...]:
    return tuple(tuple(int(v) for v in line.split()) for line in text.splitlines() if len(line.split()) == 3)


USERNS_SYSCTLS = ("user/max_user_namespaces", "kernel/unprivileged_userns_clone",
                  "kernel/apparmor_restrict_unprivileged_userns")


def read_host() -> Host:
    status = _read("/proc/self/status")
    label = (_read("/proc/self/attr/apparmor/current") or _read("/proc/self/attr/current")).strip("\x00\n ")
    masks = []
    for line in _read("/proc/self/mountinfo").splitlines():
        parts = line.split()
        # /proc/sys/fs/binfmt_misc sits on a permanently empty directory: the kernel allows that one
        if len(parts) > 4 and parts[4].startswith("/proc/") and parts[4] != "/proc/sys/fs/binfmt_misc":
            masks.append(parts[4])
    sysctls = {}
    for name in USERNS_SYSCTLS:
        value = _read(f"/proc/sys/{name}").strip()
        if value.lstrip("-").isdigit():
            sysctls[name.replace("/", ".")] = int(value)
    return Host(euid=os.geteuid(), bwrap=shutil.which("bwrap"),
                effective_caps=int(_status_field(status, "CapEff") or "0", 16),
                seccomp_mode=int(_status_field(status, "Seccomp") or "0"),
                security_label="" if label in ("", "unconfined") or ":unconfined_t:" in label else label,
                uid_map=_id_map(_read("/proc/self/uid_map")), gid_map=_id_map(_read("/proc/self/gid_map")),
                proc_masks=tuple(masks),
                in_container=any(os.path.exists(p) for p in ("/.dockerenv", "/run/.containerenv")),
                sysctls=sysctls)


def _maps(rows: tuple[tuple[int, int, int], ...], first: int, count: int) -> bool:
    """Whether ids first .. first + count - 1 are all mapped in this user namespace."""
    covered = first
    for inside, _, length in sorted(rows):
        if inside <= covered < inside + length:
            covered = inside + length
    return covered >= first + count


def certain(host: Host, settings: SandboxSettings) -> list[str]:
    """What stops bubblewrap here for sure, each with its fix (checked without starting it)."""
    if host.bwrap is None:
        return ["bubblewrap is not installed (Debian/Ubuntu: apt-get install bubblewrap; `make sandbox`)"]
    found = []
    if host.euid == 0:
        if not host.effective_caps >> CAP_SYS_ADMIN & 1:
            found.append("root here lacks CAP_SYS_ADMIN, which bwrap makes its namespaces with "
                         + ("(docker run --cap-add SYS_ADMIN)" if host.in_container else "(a container runtime "
                            "dropped it: grant it, e.g. docker run --cap-add SYS_ADMIN)"))
        last = settings.slot_uid_base + settings.slots - 1
        if host.uid_map and not (_maps(host.uid_map, settings.slot_uid_base, settings.slots)
                                 and _maps(host.gid_map, settings.slot_uid_base, settings.slots)):
            first_row = " ".join(map(str, host.uid_map[0])) if host.uid_map else "empty"
            found.append(f"root here is a user namespace's (uid_map {first_row}) that does not map the slot uids "
                         f"{settings.slot_uid_base}-{last} each test drops to: run as your own user instead (pyxis: "
                         "no --container-remap-root; enroot: no --root; podman: rootful), where bwrap makes its own "
                         "user namespace")
    else:
        if host.sysctls.get("user.max_user_namespaces", 1) == 0:
            found.append("user namespaces are off (sysctl user.max_user_namespaces=0): set it > 0, or run as root")
        if host.sysctls.get("kernel.unprivileged_userns_clone", 1) == 0:
            found.append("unprivileged user namespaces are off (sysctl kernel.unprivileged_userns_clone=1), "
                         "or run as root")
    return found


def suspects(host: Host) -> list[str]:
    """What may stop bubblewrap here: named only once the real start has failed."""
    flags = DOCKER_FLAGS if host.euid == 0 else DOCKER_FLAGS_NOT_ROOT
    found = []
    if host.seccomp_mode == 2:
        found.append("this process runs under a seccomp filter (Docker's default profile denies "
                     + ("pivot_root): --security-opt seccomp=unconfined" if host.euid == 0 else
                        "unshare without CAP_SYS_ADMIN): --security-opt seccomp=unconfined"))
    if host.security_label:
        if ":" in host.security_label:  # an SELinux context (container_t)
            found.append(f"SELinux confines this process ({host.security_label}): --security-opt label=disable")
        else:
            found.append(f"the AppArmor profile {host.security_label} confines this process (docker-default "
                         "denies mount): --security-opt apparmor=unconfined")
    if host.euid != 0:
        if host.proc_masks:
            found.append(f"/proc has files masked by other mounts ({', '.join(host.proc_masks[:3])}"
                         f"{', ...' if len(host.proc_masks) > 3 else ''}), which a user namespace may not mount "
                         "again: --security-opt systempaths=unconfined")
        if host.sysctls.get("kernel.apparmor_restrict_unprivileged_userns", 0) == 1:
            found.append("AppArmor restricts unprivileged user namespaces (Ubuntu 24.04: "
                         "kernel.apparmor_restrict_unprivileged_userns=0, or an AppArmor profile for bwrap)")
    if host.in_container and found:
        found.append(f"in Docker, every flag it needs {'as root' if host.euid == 0 else 'as this user'}: "
                     f"{docker_flags(flags)}")
    return found


def _refusal(needed_by: str, causes: list[str], said: str = "") -> str:
    text = f"sandbox: {needed_by} runs model-written code, and the sandbox cannot run here: " + "; ".join(causes)
    if said:
        text += f"; it said: {said.removeprefix('sandbox: ')}"
    return (text + f"; or set {UNSAFE_VARIABLE}=1 to run the code with rlimits only (unsafe) "
            "(docs/13-code-rl.md, 'On a cluster')").replace("\n", " ")


def preflight(needed_by: str, settings: SandboxSettings | None = None, host: Host | None = None,
              languages=()) -> None:
    """Raise SandboxUnavailable in one line unless the sandbox runs here, and judges `languages`
    (reward.code.languages: C++ needs g++); `needed_by` names what in the config runs
    model-written code (e.g. "reward.name: code"). Cheap enough for every start-up: the static
    checks, then one trivial program in the real sandbox (~0.1-0.2 s)."""
    settings = settings or SandboxSettings.from_env()
    if not settings.unsafe_no_isolation:
        host = host or read_host()
        if found := certain(host, settings):
            raise SandboxUnavailable(_refusal(needed_by, found))
    try:
        check_sandbox(settings)
    except SandboxUnavailable as err:
        causes = suspects(host) if host is not None else []
        raise SandboxUnavailable(_refusal(needed_by, causes or ["the trivial program failed"], str(err))) from None
    try:
        check_languages(languages, settings, prepare=True)  # C++: the precompiled header built here, once per host
    except SandboxUnavailable as err:
        raise SandboxUnavailable(f"sandbox: {needed_by}: {str(err).removeprefix('sandbox: ')}") from None
