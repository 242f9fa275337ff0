"""launch/gpu_check.py on CPU, as a bare GPU machine would run it: a Python that has torch,
transformers and their own dependencies only, the repository, and the wheel folder
launch/wheelhouse.sh fills (here built from this machine's installed distributions of exactly
the pinned names and versions, since the suite runs offline); every section that can run on CPU
at the tiny shape. The check's pieces (lines, child processes, sections as functions) have their
fast tests in test_gpu_check_parts.py."""

import importlib.metadata as metadata
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement

from helpers import REPO

sys.path.insert(0, str(REPO / "launch"))
from gpucheck.wheels import wheel_paths  # noqa: E402

sys.path.remove(str(REPO / "launch"))

WHEELHOUSE = REPO / "launch" / "wheelhouse.sh"


def pinned_wheels() -> dict[str, str]:
    """name -> version of the wheels launch/wheelhouse.sh downloads."""
    listed = re.search(r"^wheels=\((.*?)\)$", WHEELHOUSE.read_text(), re.S | re.M).group(1)
    return dict(pin.split("==") for pin in listed.split())


def closure(names: list[str]) -> dict[str, metadata.Distribution]:
    """The installed distributions `names` need (their requirements, without extras), themselves included."""
    environment = {**default_environment(), "extra": ""}
    found, todo = {}, list(names)
    while todo:
        name = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in found:
            continue
        try:
            found[key] = dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        for requirement in map(Requirement, dist.requires or []):
            if requirement.marker is None or requirement.marker.evaluate(environment):
                todo.append(requirement.name)
    return found


def bare_site(folder: Path) -> Path:
    """A site folder holding torch and transformers with their dependencies only (links)."""
    folder.mkdir()
    for dist in closure(["torch", "transformers"]).values():
        base = Path(dist.locate_file(""))
        for top in {Path(str(f)).parts[0] for f in dist.files or []}:
            if not top.startswith("..") and top != "__pycache__" and (base / top).exists():
                (folder / top).symlink_to(base / top)
    return folder


def wheel_of(name: str, folder: Path) -> Path:
    """The installed distribution `name` packed as the wheel it was installed from (its RECORD's files)."""
    dist = metadata.distribution(name)
    base = Path(dist.locate_file(""))
    files = [f for f in dist.files if not str(f).startswith("..") and "__pycache__" not in str(f)]
    wheel = folder / f"{dist.metadata['Name'].replace('-', '_')}-{dist.version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for f in files:
            if (base / f).is_file():
                archive.write(base / f, str(f))
    return wheel


def test_a_pure_wheel_imports_from_its_zip_and_a_compiled_one_is_unpacked_once(tmp_path):
    folder, cache = tmp_path / "wheels", tmp_path / "cache"
    folder.mkdir()
    for name, pure, extra in (("purepkg", "true", {}), ("natpkg", "false", {"natpkg/_speed.so": b"\x7fELF"})):
        with zipfile.ZipFile(folder / f"{name}-1.0-py3-none-any.whl", "w") as archive:
            archive.writestr(f"{name}/__init__.py", "VALUE = 7\n")
            archive.writestr(f"{name}-1.0.dist-info/WHEEL", f"Wheel-Version: 1.0\nRoot-Is-Purelib: {pure}\n")
            for path, data in extra.items():
                archive.writestr(path, data)
    paths = wheel_paths(folder, cache)
    assert paths == [cache / "natpkg-1.0-py3-none-any", folder / "purepkg-1.0-py3-none-any.whl", folder]
    assert (cache / "natpkg-1.0-py3-none-any" / "natpkg" / "_speed.so").read_bytes() == b"\x7fELF"
    out = subprocess.run([sys.executable, "-c", "import sys, natpkg, purepkg; sys.path[:0] = sys.argv[1:]; "
                          "print(purepkg.__file__)"], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(map(str, paths))})
    assert out.returncode == 0 and ".whl" in out.stdout  # imported from inside the zip
    (cache / "natpkg-1.0-py3-none-any" / "natpkg" / "_speed.so").write_bytes(b"kept")
    wheel_paths(folder, cache)  # unpacked once: a second run reuses it
    assert (cache / "natpkg-1.0-py3-none-any" / "natpkg" / "_speed.so").read_bytes() == b"kept"


def test_the_wheelhouse_pins_what_this_project_runs(tmp_path):
    """The versions it downloads are the ones the tests run (.venv), megatron-core the pinned one;
    a Python the check does not run on is one line, exit 2."""
    pins = pinned_wheels()
    assert pins["megatron-core"] == "0.16.1"
    assert {name: metadata.version(name) for name in pins} == pins
    proc = subprocess.run(["bash", str(WHEELHOUSE), str(tmp_path / "w"), "3.9"], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.strip().endswith("runs on Python 3.11 or 3.12")


@pytest.mark.slow  # ~50 s (2 cores): every section's children forked from one server that imported once
def test_the_check_runs_on_a_bare_machine_from_the_wheel_folder(tmp_path):
    """No site-packages but torch's and transformers' own, the wheel folder on the path by the
    check itself: sections 1-4 and 7-10 pass (megatron-core from the unpacked wheel), each learner
    in a child process; the CUDA ones skip, and so do section 3's CUDA-only arms (before anything
    is built). --out holds the lines stdout printed."""
    site = bare_site(tmp_path / "site")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for name in pinned_wheels():
        wheel_of(name, wheels)
    env = {**os.environ, "PYTHONPATH": str(site), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    check = [sys.executable, "-S", str(REPO / "launch/gpu_check.py"), "--device", "cpu", "--wheels", str(wheels),
             "--work", str(tmp_path / "work")]
    proc = subprocess.run([*check, "--out", str(tmp_path / "out")], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=600)
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [(line["section"], line.get("part"), line["result"]) for line in lines] == [
        (1, None, "PASS"), (6, None, "SKIP"), (2, None, "PASS"), (9, None, "PASS"), (3, "offload", "SKIP"),
        (3, "device_adam", "PASS"), (3, "precision_aware", "SKIP"), (3, None, "PASS"), (10, None, "PASS"),
        (5, None, "SKIP"), (7, None, "PASS"), (8, None, "PASS"), (4, None, "PASS")]  # registry.ORDER
    assert (tmp_path / "out/gpu_check.jsonl").read_text().splitlines() == proc.stdout.splitlines()
    first, _, parity, speed, _, arm, aware, update, step, _, sync, host_adam, resume = lines
    assert first["megatron_core"] == "0.16.1" and first["megatron_from"].startswith(str(tmp_path / "cache"))
    assert first["te_compat"]["moe_utils.te_general_gemm"] == "None (torch.mm)"
    assert parity["export_bitwise_identical"] and parity["top1_agreement"] == 1.0
    assert arm["params_moved"] > 0 and arm["grad_norm"] > 0 and arm["planned_gb"] > 0
    assert aware["skip"].startswith("optimizer.precision_aware: needs CUDA")
    assert update["arms"] == {"offload": "SKIP", "device_adam": "PASS", "precision_aware": "SKIP"}
    # float32 on both sides: the push's log-probs are the trainer's; the stale weights' are not
    assert sync["sync_check_median"] <= 1e-5 < sync["stale_median"] and sync["tolerance"] == 0.01
    assert resume["params_equal"] and resume["optimizer_equal"] and resume["stepped_again"]
    assert {"exp_avg", "exp_avg_sq", "main"} <= set(resume["optimizer_states"])
    assert set(host_adam["cpu_step_ns_per_param"]) == {"2", "16"} and host_adam["copy_to_host_ns_per_param"] is None
    # the tiny shape's 2 layers, GPU Adam's config; timed phases and a profile, no MFU without CUDA
    assert speed["layers"] == 2 and speed["overrides"][0] == "optimizer.cpu_offload=false" and speed["tokens"] == 128
    assert speed["timed_updates"] == 2 and speed["tokens_per_s"] > 0 and speed["mfu"] is None
    assert speed["mfu_target"] == 0.30 and speed["planned_gb"] > 0 and speed["top_kernels"]
    assert all(speed[key] >= 0 for key in ("forward_s", "backward_s", "optimizer_s", "logits_s", "other_s"))
    # the rehearsal's step run for real (a count of real storages on CPU) and rehearsed, from the wheel folder
    assert list(step["phases"]) == ["training", "weight push", "sync check"] and step["rehearsal_within"]
    # One section alone, in a fresh interpreter of its own (the CUDA default).
    alone = subprocess.run([*check, "--only", "2", "--children", "spawn"], capture_output=True, text=True, env=env,
                           cwd=tmp_path, timeout=600)
    assert [json.loads(line)["section"] for line in alone.stdout.splitlines()] == [2] and alone.returncode == 0
