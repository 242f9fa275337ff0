"""Installing the package where users train leaves their torch alone (setup.py declares ranges;
the exact versions tested are in constraints.txt)."""

import json
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

from helpers import REPO

# A user's GPU environment: SGLang 0.5.23's image has torch 2.14.1 (a CUDA build), not the
# CPU 2.13.0 this project tests with.
USER_TORCH = "2.14.1+cu130"


def _requirements() -> list[str]:
    setup = (REPO / "setup.py").read_text()
    block = setup[setup.index("INSTALL_REQUIRES = [") :]
    return re.findall(r'^\s+"([^"]+)",', block[: block.index("]\n")], re.M)


def _fake_installed(site: Path, name: str, version: str) -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "INSTALLER").write_text("pip\n")
    (info / "RECORD").write_text("")


def test_install_into_an_environment_with_another_torch_keeps_it(tmp_path):
    """pip resolves the package against what is installed, offline: with the user's torch (and
    every other dependency at the tested version) it installs only gspo-mcore. An exact
    `torch==2.13.0` requirement made pip replace the user's torch (here: fail offline)."""
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w",
                    str(wheels), str(REPO)], check=True, capture_output=True, timeout=300)
    env_dir = tmp_path / "user-env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120)
    purelib = sysconfig.get_paths(vars={"base": str(env_dir), "platbase": str(env_dir)})["purelib"]
    site = Path(purelib)
    tested = dict(re.findall(r"^([A-Za-z0-9_.\-]+)==([0-9.]+)", (REPO / "constraints.txt").read_text(), re.M))
    for requirement in _requirements():
        name = re.match(r"[A-Za-z0-9_.\-]+", requirement)[0]
        _fake_installed(site, name, USER_TORCH if name == "torch" else tested[name])
    report = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(env_dir / "bin" / "python"), "install",
                           "--dry-run", "--no-index", "--find-links", str(wheels), "--report", str(report),
                           "gspo-mcore"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    installs = [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]]
    assert installs == ["gspo-mcore"], installs


def test_make_install_says_what_it_does_and_asks_for_the_cpu_torch_by_its_local_version():
    """The install was silent for minutes, and its bare `torch==2.13.0` is the CUDA build wherever pip
    is not pointed at a CPU wheel (as it is on this machine). What `make` would run, not run."""
    for target, venv in ((".venv/.installed", ".venv"), (".venv-vllm/.installed", ".venv-vllm")):
        dry = subprocess.run(["make", "-n", "-W", "setup.py", "-W", "gspo_mcore/engines/vllm/constraints-cpu.txt",
                              target], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert dry.returncode == 0, dry.stderr
        torch = [line for line in dry.stdout.splitlines() if re.search(r"pip install .*\btorch==", line)]
        assert torch and all(re.search(r"\btorch==2\.13\.0\+cpu\b", line) for line in torch), torch
        # pip's own configuration first (a mirror, a wheel directory; here only PyPI is reachable), then PyTorch's index
        first = f"{venv}/bin/python -m pip install --quiet --no-compile torch==2.13.0+cpu 2>/dev/null"
        assert torch[0].split(" || ")[0] == first
        assert "--extra-index-url https://download.pytorch.org/whl/cpu" in torch[0].split(" || ")[1]
        assert re.search(r"^echo \"install", dry.stdout, re.M), dry.stdout
