"""Launch scripts as far as a CPU machine can check them: shellcheck, bash -n, rendered
sbatch templates, the wait-for-server / teardown logic against local processes, and the
single-node script end to end with the CPU config (a real SGLang server + the trainer)."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO
from gspo_mcore.parallel import free_port

pytestmark = pytest.mark.slow  # starts torchrun and SGLang servers

SCRIPTS = sorted((REPO / "launch").glob("*.sh"))
TEMPLATES = sorted((REPO / "launch" / "slurm").glob("*.sbatch"))
# Debian's shellcheck, installed by `make test` (Makefile: shellcheck target).
SHELLCHECK = shutil.which("shellcheck") or "shellcheck (not on PATH: `make test` installs it, or apt-get install shellcheck)"
VALUES = {"JOB_NAME": "gspo-test", "TIME": "04:00:00", "OUTPUT_DIR": "/scratch/runs/a b", "REPO": "/opt/gspo-mcore",
          "PYTHON": "python", "CONFIG": "configs/qwen3_30b_a3b_gspo_2node.yaml",
          "OVERRIDES": "train.steps=10 optimizer.lr=2e-6"}


def _render(template: Path, **values) -> subprocess.CompletedProcess:
    args = [f"{k}={v}" for k, v in values.items()]
    return subprocess.run([sys.executable, "launch/slurm/render.py", str(template), *args], capture_output=True,
                          text=True, cwd=REPO)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_are_shellcheck_clean(script):
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    proc = subprocess.run([SHELLCHECK, "-x", "-P", str(REPO), str(script)], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stdout


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda p: p.name)
def test_sbatch_templates_render_and_check(template, tmp_path):
    values = dict(VALUES, **({"TRAINER_NODES": "2", "ROLLOUT_NODES": "1"} if "multi" in template.name else {}))
    proc = _render(template, **values)
    assert proc.returncode == 0, proc.stderr
    rendered = tmp_path / template.name
    rendered.write_text(proc.stdout)
    assert "{{" not in proc.stdout
    assert "#SBATCH --job-name=gspo-test" in proc.stdout and "#SBATCH --requeue" in proc.stdout
    assert "'/scratch/runs/a b'/logs" in proc.stdout  # paths are quoted shell words
    assert "train.steps=10 optimizer.lr=2e-6" in proc.stdout
    if "multi" in template.name:
        assert "#SBATCH --nodes=3" in proc.stdout and "GSPO_TRAINER_NODES=2" in proc.stdout
    assert subprocess.run(["bash", "-n", str(rendered)]).returncode == 0
    check = subprocess.run([SHELLCHECK, "-s", "bash", str(rendered)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout


def test_render_names_a_missing_or_unknown_value():
    proc = _render(REPO / "launch/slurm/gspo_single_node.sbatch", **{k: v for k, v in VALUES.items() if k != "TIME"})
    assert proc.returncode == 2 and proc.stderr.strip().endswith("missing value for TIME") and proc.stdout == ""
    proc = _render(REPO / "launch/slurm/gspo_single_node.sbatch", **VALUES, NODES_PER_JOB="2")
    assert proc.returncode == 2 and "NODES_PER_JOB: not a field of this template" in proc.stderr


def _bash(script: str, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f"set -euo pipefail; source launch/lib.sh; {script}"], capture_output=True,
                          text=True, cwd=REPO, timeout=timeout)


def test_wait_for_a_local_server_then_teardown_leaves_no_process(tmp_path):
    (tmp_path / "health").write_text("ok")
    port = free_port()
    pid_file = tmp_path / "pid"
    proc = _bash(f"trap gspo_teardown EXIT; gspo_start {tmp_path}/server.log {sys.executable} -m http.server {port} "
                 f"--bind 127.0.0.1 --directory {tmp_path}; echo ${{GSPO_PIDS[0]}} > {pid_file}; "
                 f"gspo_wait_healthy http://127.0.0.1:{port} 30 ${{GSPO_PIDS[0]}}")
    assert proc.returncode == 0, proc.stderr
    assert f"server http://127.0.0.1:{port} is healthy" in proc.stderr
    pid = int(pid_file.read_text())
    time.sleep(0.5)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # torn down on exit


def test_wait_fails_in_bounded_time_and_on_an_early_exit(tmp_path):
    port = free_port()
    start = time.monotonic()
    proc = _bash(f"gspo_wait_healthy http://127.0.0.1:{port} 2")
    assert proc.returncode == 1 and f"error: server http://127.0.0.1:{port} not healthy after 2s" in proc.stderr
    assert time.monotonic() - start < 10
    proc = _bash(f"trap gspo_teardown EXIT; gspo_start {tmp_path}/x.log {sys.executable} -c 'raise SystemExit(3)'; "
                 f"gspo_wait_healthy http://127.0.0.1:{port} 30 ${{GSPO_PIDS[0]}}")
    assert proc.returncode == 1 and "exited while starting" in proc.stderr


def test_failure_mid_run_tears_down_the_started_servers(tmp_path):
    (tmp_path / "health").write_text("ok")
    port = free_port()
    proc = _bash(f"trap gspo_teardown EXIT; gspo_start {tmp_path}/s.log {sys.executable} -m http.server {port} "
                 f"--bind 127.0.0.1 --directory {tmp_path}; echo ${{GSPO_PIDS[0]}} > {tmp_path}/pid; "
                 f"gspo_wait_healthy http://127.0.0.1:{port} 30; false")
    assert proc.returncode == 1
    time.sleep(0.5)
    with pytest.raises(ProcessLookupError):
        os.kill(int((tmp_path / "pid").read_text()), 0)


def test_single_node_script_end_to_end_on_cpu(tmp_path):
    """launch/train_8xh100.sh with the CPU config, split mode on a pretend 2-GPU node: the
    planner's layout, a real SGLang server on the first 'GPU', the trainer on the second."""
    from gspo_mcore.toy_task import make_toy_task

    toy = make_toy_task(tmp_path / "toy", seed=0)
    out = tmp_path / "run"
    env = {**os.environ, "GSPO_PYTHON": sys.executable, "GSPO_GPUS_PER_NODE": "2", "GSPO_BASE_PORT": str(free_port()),
           "GSPO_SERVER_TIMEOUT": "300", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(["launch/train_8xh100.sh", "configs/tiny_cpu.yaml", str(out), f"model.hf_dir={toy}/model",
                           f"data.path={toy}/prompts.jsonl", "train.steps=2", "train.save_every=0",
                           "train.export_hf=false", "weight_sync.check_every=1"],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trainer on GPUs 1" in proc.stderr
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    assert (out / "logs" / "sglang_0.log").stat().st_size > 0
    assert list((out / "logs" / "torchrun").rglob("stdout.log"))


def test_multi_node_script_colocated_on_one_cpu_node(tmp_path):
    """launch/node.sh as the multi-node template runs it, with a one-node allocation and a
    colocated config: the node serves SGLang and trains (torchrun's c10d rendezvous at
    MASTER_ADDR:MASTER_PORT), and the weights go to the server on the trainer's own "GPU"
    (method tensor, the colocated configs' path; shared memory on CPU)."""
    from gspo_mcore.toy_task import make_toy_task

    toy = make_toy_task(tmp_path / "toy", seed=0)
    out = tmp_path / "run"
    env = {**os.environ, "GSPO_PYTHON": sys.executable, "GSPO_GPUS_PER_NODE": "1", "GSPO_NODES": "127.0.0.1",
           "GSPO_TRAINER_NODES": "1", "GSPO_NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "GSPO_BASE_PORT": str(free_port()), "GSPO_SERVER_TIMEOUT": "300",
           "GSPO_SGLANG_API_KEY": "test-key",
           "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(["launch/node.sh", "configs/tiny_cpu.yaml", str(out), f"model.hf_dir={toy}/model",
                           f"data.path={toy}/prompts.jsonl", "weight_sync.colocate=true", "weight_sync.method=tensor", "train.steps=1",
                           "train.save_every=0", "train.export_hf=false", "weight_sync.check_every=1"],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = (out / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 1 and "sync_check_median" in rows[0]
    assert (out / "logs" / "127.0.0.1" / "sglang_0.log").stat().st_size > 0


def test_convert_script_on_a_small_checkpoint(tmp_path):
    """launch/convert_qwen3_30b.sh as a user runs it (conversion + verify), on the toy model."""
    from gspo_mcore.models.qwen3_moe.tiny import make_tiny_checkpoint

    hf = make_tiny_checkpoint(tmp_path / "hf", seed=0)
    env = {**os.environ, "GSPO_PYTHON": sys.executable, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(["launch/convert_qwen3_30b.sh", str(hf), str(tmp_path / "mcore")], capture_output=True,
                          text=True, cwd=REPO, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "mcore" / "latest_checkpointed_iteration.txt").read_text().strip() == "release"
    assert json.loads(proc.stdout.strip().splitlines()[-1])["ok"] is True
    proc = subprocess.run(["launch/convert_qwen3_30b.sh", str(hf)], capture_output=True, text=True, cwd=REPO, env=env)
    assert proc.returncode == 2 and "usage:" in proc.stderr


def test_dockerfile_pins_agree_with_the_constraints():
    """The image installs the versions constraints.txt names (it cannot be built here: no GPU,
    no Docker)."""
    import re

    pins = dict(re.findall(r"^([A-Za-z0-9_.\-]+)==([0-9.]+)", (REPO / "constraints.txt").read_text(), re.M))
    docker = (REPO / "Dockerfile").read_text()
    image = dict(re.findall(r"\b([a-z][a-z0-9\-]+)==([0-9.]+)", docker))
    assert image, "no pinned packages found in the Dockerfile"
    for name, version in image.items():
        assert pins.get(name) == version, (name, version, pins.get(name))
    assert re.search(r"^FROM lmsysorg/sglang:v" + re.escape(pins["sglang"]) + r"\b", docker, re.M)
    assert "TE_VERSION=" + pins["transformer-engine"] in docker


def test_multi_node_split_rollout_node_stops_when_training_ends(tmp_path):
    """launch/node.sh with a trainer node and a rollout node (two 'nodes' on this machine): the
    rollout node serves, the trainer node trains against it over the API key, and when training
    has ended the rollout node stops its server and exits 0 (it used to serve forever, keeping
    the Slurm step alive)."""
    from gspo_mcore.toy_task import make_toy_task

    toy = make_toy_task(tmp_path / "toy", seed=0)
    out = tmp_path / "run"
    env = {**os.environ, "GSPO_PYTHON": sys.executable, "GSPO_GPUS_PER_NODE": "1", "GSPO_NODES": "127.0.0.1 localhost",
           "GSPO_TRAINER_NODES": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "GSPO_BASE_PORT": str(free_port()), "GSPO_SERVER_TIMEOUT": "300", "GSPO_SGLANG_API_KEY": "split-key",
           "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    args = ["launch/node.sh", "configs/tiny_cpu.yaml", str(out), f"model.hf_dir={toy}/model",
            f"data.path={toy}/prompts.jsonl", "train.steps=1", "train.save_every=0", "train.export_hf=false",
            "weight_sync.check_every=1"]
    rollout = subprocess.Popen(args, cwd=REPO, env={**env, "GSPO_NODE_RANK": "1"}, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    try:
        trainer = subprocess.run(args, capture_output=True, text=True, cwd=REPO, env={**env, "GSPO_NODE_RANK": "0"},
                                 timeout=600)
        assert trainer.returncode == 0, trainer.stderr[-3000:]
        _, stderr = rollout.communicate(timeout=60)
        assert rollout.returncode == 0 and "training has ended" in stderr, stderr[-2000:]
    finally:
        if rollout.poll() is None:
            rollout.kill()
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1
    assert (out / "logs" / "localhost" / "sglang_0.log").stat().st_size > 0


def test_multi_node_script_reports_the_planners_own_error(tmp_path, tiny_hf_dir):
    """A layout the planner refuses stops node.sh with the planner's one-line error (it used to
    surface later as 'unbound variable')."""
    env = {**os.environ, "GSPO_PYTHON": sys.executable, "GSPO_GPUS_PER_NODE": "1", "GSPO_NODES": "127.0.0.1",
           "GSPO_TRAINER_NODES": "1", "GSPO_NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1",
           "GSPO_SGLANG_API_KEY": "k", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(["launch/node.sh", "configs/tiny_cpu.yaml", str(tmp_path / "run"),
                           f"model.hf_dir={tiny_hf_dir}"], capture_output=True,
                          text=True, cwd=REPO, env=env, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: rollout: 1 servers x engine_tp 1 = 1 GPUs"), proc.stderr
    assert "unbound variable" not in proc.stderr
