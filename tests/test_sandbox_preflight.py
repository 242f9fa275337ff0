"""The sandbox's pre-flight (gspo_mcore.sandbox.preflight): at start-up, before any server or model,
one line naming what stops bubblewrap here and how to grant it; the docs' `docker run` lines
carrying every flag it needs; the capabilities those flags grant, each taken away on this machine."""

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

from helpers import REPO
from gspo_mcore.sandbox import SandboxSettings, SandboxUnavailable
from gspo_mcore.sandbox import preflight as preflight_module
from gspo_mcore.sandbox.preflight import (CAP_SYS_ADMIN, DOCKER_FLAGS, DOCKER_FLAGS_NOT_ROOT, Host, certain,
                                          preflight, read_host)

ROOT_IN_DOCKER = Host(euid=0, bwrap="/usr/bin/bwrap", effective_caps=(1 << 41) - 1, seccomp_mode=0,
                      security_label="", uid_map=((0, 0, 4294967295),), gid_map=((0, 0, 4294967295),),
                      in_container=True)


def never_started(*args, **kwargs):
    raise AssertionError("the sandbox was started: the static check should have refused first")


def refused(host: Host | None, needed_by="reward.name: code") -> str:
    with pytest.raises(SandboxUnavailable) as error:
        preflight(needed_by, SandboxSettings(), host)
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"sandbox: {needed_by} runs model-written code")
    return message


def test_no_bubblewrap_on_path_is_one_line_before_anything_starts(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(preflight_module, "check_sandbox", never_started)
    message = refused(None)
    assert "bubblewrap is not installed" in message and "apt-get install bubblewrap" in message


@pytest.mark.parametrize("host, says", [
    (dataclasses.replace(ROOT_IN_DOCKER, effective_caps=ROOT_IN_DOCKER.effective_caps & ~(1 << CAP_SYS_ADMIN)),
     "lacks CAP_SYS_ADMIN, which bwrap makes its namespaces with (docker run --cap-add SYS_ADMIN)"),
    (dataclasses.replace(ROOT_IN_DOCKER, uid_map=((0, 1000, 1),), gid_map=((0, 1000, 1),)),  # pyxis --container-remap-root
     "uid_map 0 1000 1) that does not map the slot uids 61000-"),
    (dataclasses.replace(ROOT_IN_DOCKER, euid=1000, sysctls={"user.max_user_namespaces": 0}),
     "user namespaces are off (sysctl user.max_user_namespaces=0)"),
    (dataclasses.replace(ROOT_IN_DOCKER, euid=1000, sysctls={"kernel.unprivileged_userns_clone": 0}),
     "kernel.unprivileged_userns_clone=1"),
], ids=["no-cap-sys-admin", "remapped-root", "no-user-namespaces", "no-unprivileged-clone"])
def test_what_certainly_stops_bwrap_is_refused_without_starting_it(monkeypatch, host, says):
    monkeypatch.setattr(preflight_module, "check_sandbox", never_started)
    message = refused(host)
    assert says in message and "GSPO_SANDBOX_UNSAFE_NO_ISOLATION=1" in message


def test_slot_uids_are_mapped_when_a_namespace_maps_them_in_pieces():
    settings = SandboxSettings()
    pieces = ((0, 0, 61000), (61000, 200000, 65536))
    assert certain(dataclasses.replace(ROOT_IN_DOCKER, uid_map=pieces, gid_map=pieces), settings) == []
    short = ((0, 0, 61010),)
    assert certain(dataclasses.replace(ROOT_IN_DOCKER, uid_map=short, gid_map=short), settings)


def test_a_failed_start_names_what_here_may_be_the_cause_and_every_docker_flag(monkeypatch):
    """Docker's defaults as root with only SYS_ADMIN added: the seccomp filter and the AppArmor
    profile are what the failed start is laid to, with the whole list of flags."""
    def fails(settings):
        raise SandboxUnavailable("sandbox: bubblewrap could not start (bwrap: pivot_root: Operation not permitted)")

    monkeypatch.setattr(preflight_module, "check_sandbox", fails)
    host = dataclasses.replace(ROOT_IN_DOCKER, seccomp_mode=2, security_label="docker-default (enforce)")
    message = refused(host, "rollout.tools: gspo_mcore.tools.python:python")
    assert "seccomp filter (Docker's default profile denies pivot_root): --security-opt seccomp=unconfined" in message
    assert "AppArmor profile docker-default (enforce)" in message and "--security-opt apparmor=unconfined" in message
    assert "every flag it needs as root: --cap-add SYS_ADMIN --security-opt seccomp=unconfined " \
           "--security-opt apparmor=unconfined" in message
    assert "it said: bubblewrap could not start (bwrap: pivot_root: Operation not permitted)" in message
    user = dataclasses.replace(host, euid=1000, proc_masks=("/proc/acpi", "/proc/kcore"))
    message = refused(user)
    assert "/proc has files masked by other mounts (/proc/acpi, /proc/kcore)" in message
    assert "--security-opt systempaths=unconfined" in message


def test_the_sandbox_present_passes_here():
    """This machine (make test installs bubblewrap): the static checks and one real program."""
    host = read_host()
    assert host.bwrap and certain(host, SandboxSettings()) == []
    preflight("reward.name: code")


def test_bwrap_runs_here():
    done = subprocess.run(["bwrap", "--version"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and re.match(r"bubblewrap \d+\.\d+", done.stdout), done


# ---- each flag's capability taken away on this machine (root here: the image's case)

PROBE = textwrap.dedent("""
    from gspo_mcore.sandbox import SandboxUnavailable
    from gspo_mcore.sandbox.preflight import preflight
    try:
        preflight("reward.name: code")
        print("PASS")
    except SandboxUnavailable as error:
        print(error)
""")
# Docker's default seccomp profile with --cap-add SYS_ADMIN: pivot_root is in none of its allow
# lists (moby profiles/seccomp/default.json), so it answers EPERM; the rest of bwrap's calls pass.
DENY_PIVOT_ROOT = textwrap.dedent("""
    import ctypes, ctypes.util, os, sys
    lib = ctypes.CDLL(ctypes.util.find_library("seccomp"))
    lib.seccomp_init.restype = ctypes.c_void_p
    context = ctypes.c_void_p(lib.seccomp_init(ctypes.c_uint32(0x7FFF0000)))
    number = lib.seccomp_syscall_resolve_name(b"pivot_root")
    assert lib.seccomp_rule_add(context, ctypes.c_uint32(0x00050000 | 1), number, 0) == 0
    assert lib.seccomp_load(context) == 0
    os.execv(sys.executable, [sys.executable, "-c", sys.argv[1]])
""")
root_with_bwrap = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("bwrap") is None
                                     or (read_host().effective_caps >> CAP_SYS_ADMIN & 1) == 0,
                                     reason="needs root with CAP_SYS_ADMIN and bubblewrap")


def run_probe(*prefix: str, deny_pivot_root: bool = False) -> str:
    """PROBE's one line, run behind `prefix` (or the seccomp filter)."""
    command = [sys.executable, "-c", DENY_PIVOT_ROOT, PROBE] if deny_pivot_root else [*prefix, sys.executable, "-c",
                                                                                       PROBE]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


@root_with_bwrap
def test_root_without_cap_sys_admin_is_named():
    said = run_probe("setpriv", "--bounding-set=-sys_admin", "--inh-caps=-sys_admin")
    assert "root here lacks CAP_SYS_ADMIN" in said and "--cap-add SYS_ADMIN" in said, said


@root_with_bwrap
def test_a_seccomp_filter_denying_pivot_root_stops_bwrap_and_is_named():
    said = run_probe(deny_pivot_root=True)
    assert "pivot_root: Operation not permitted" in said and "--security-opt seccomp=unconfined" in said, said


@root_with_bwrap
def test_root_needs_no_unmasked_proc():
    """Docker's masks over /proc (a tmpfs over /proc/acpi, /proc/sys read-only): root's bwrap
    still mounts its own /proc, so DOCKER_FLAGS leaves systempaths=unconfined out."""
    masks = "mount -t tmpfs tmpfs /proc/acpi && mount -o bind,ro /proc/sys /proc/sys && exec \"$0\" \"$@\""
    said = run_probe("unshare", "--mount", "--propagation", "private", "sh", "-c", masks)
    assert said == "PASS"


# ---- the docs hold the flags

def docker_run_commands(text: str) -> list[str]:
    """Each `docker run ...` command of a text, its continuation lines joined."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [line[line.index("docker run"):] for line in joined.splitlines() if "docker run --gpus" in line]


@pytest.mark.parametrize("doc", ["README.md", "docs/08-gpu.md"])
def test_the_documented_docker_run_lines_carry_every_flag_the_sandbox_needs(doc):
    commands = docker_run_commands((REPO / doc).read_text())
    assert commands, f"{doc}: no `docker run --gpus` line"
    for command in commands:
        words = command.split()
        pairs = set(zip(words, words[1:]))
        missing = [f"{flag} {value}" for flag, value, _ in DOCKER_FLAGS if (flag, value) not in pairs]
        assert not missing, f"{doc}: {command!r} lacks {missing}"


def test_the_sandbox_doc_names_every_flag_as_root_and_as_another_user():
    text = re.sub(r"\s+", " ", (REPO / "docs/13-code-rl.md").read_text())
    for flag, value, _ in DOCKER_FLAGS + DOCKER_FLAGS_NOT_ROOT:
        assert f"{flag} {value}" in text, f"docs/13-code-rl.md does not name {flag} {value}"
    assert "--container-remap-root" in text


def test_the_image_installs_bubblewrap_and_libseccomp():
    runs = " ".join(line for line in (REPO / "Dockerfile").read_text().splitlines() if not line.lstrip().startswith("#"))
    install = re.search(r"apt-get install[^&]*", runs)
    assert install and {"bubblewrap", "libseccomp2"} <= set(install.group(0).split())


# ---- at the run's start-up (gspo_mcore.run.start.check_inputs, before the Trainer builds anything)

def test_start_up_names_every_user_of_the_sandbox():
    from gspo_mcore.config import load_config
    from gspo_mcore.run.start import sandbox_users

    config = load_config(None, data={
        "reward": {"name": "gspo_mcore.rewards.code:code_group_reward", "batched": True},
        "rollout": {"function": "tool_loop", "tools": ["gspo_mcore.tools.python:python"]},
        "eval": {"datasets": [{"name": "lcb", "path": "lcb.jsonl", "reward": "code_all"},
                              {"name": "math", "path": "math.jsonl", "reward": "math"}]}})
    assert sandbox_users(config) == ["reward.name: gspo_mcore.rewards.code:code_group_reward",
                                     "eval.datasets[0].reward: code_all",
                                     "rollout.tools: gspo_mcore.tools.python:python"]
    assert sandbox_users(load_config(None, data={"reward": {"name": "gspo_mcore.tasks.code:program_rewards"}})) == [
        "reward.name: gspo_mcore.tasks.code:program_rewards"]
    assert sandbox_users(load_config(None, data={"reward": {"name": "math"}})) == []


def test_a_run_whose_reward_runs_code_stops_at_start_up_without_bubblewrap(monkeypatch, tmp_path):
    from gspo_mcore.config import load_config
    from gspo_mcore.run.start import check_inputs

    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "p", "answer": "a"}\n')
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(preflight_module, "check_sandbox", never_started)
    check_inputs(load_config(None, [f"data.path={data}"]), tmp_path, resume=False)  # math: no sandbox asked
    with pytest.raises(SandboxUnavailable) as error:
        check_inputs(load_config(None, [f"data.path={data}", "reward.name=code"]), tmp_path, resume=False)
    assert "\n" not in str(error.value)
    assert str(error.value).startswith("sandbox: reward.name: code runs model-written code, and the sandbox cannot "
                                       "run here: bubblewrap is not installed")
