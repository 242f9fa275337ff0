"""Launch scripts as far as a CPU machine can check them: shellcheck, bash -n, rendered
sbatch scripts (run with stand-ins for srun/scontrol), the wait-for-server / teardown logic against local processes, and the
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
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_are_shellcheck_clean(script):
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    proc = subprocess.run([SHELLCHECK, "-x", "-P", str(REPO), str(script)], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stdout


def test_sbatch_scripts_check_and_keep_their_defaults_where_sbatch_reads_them():
    for script in TEMPLATES:
        lines = script.read_text().splitlines()
        first_command = next(i for i, line in enumerate(lines) if line.strip() and not line.startswith("#"))
        directives = [i for i, line in enumerate(lines) if line.startswith("#SBATCH")]
        # sbatch stops reading #SBATCH lines at the first command
        assert directives and max(directives) < first_command, script
        assert "{{" not in script.read_text()
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
        check = subprocess.run([SHELLCHECK, "-x", "-P", str(REPO), str(script)], capture_output=True, text=True,
                               cwd=REPO)
        assert check.returncode == 0, check.stdout


def _fake_slurm(tmp_path: Path) -> tuple[dict, Path]:
    """`scontrol` and `srun` stand-ins on PATH; srun records its arguments and environment."""
    bin_dir, record = tmp_path / "bin", tmp_path / "srun.json"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\nprintf 'gpu-a\\ngpu-b\\ngpu-c\\n'\n")
    (bin_dir / "srun").write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                                  f"json.dump({{'args': sys.argv[1:], 'env': dict(os.environ), 'cwd': os.getcwd()}}, "
                                  f"open({str(record)!r}, 'w'))\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4321",
           "SLURM_JOB_NODELIST": "gpu-[a-c]", "SLURM_SUBMIT_DIR": str(REPO), "GSPO_PYTHON": sys.executable}
    return env, record


def test_multi_node_sbatch_takes_config_output_and_overrides_as_arguments(tmp_path):
    """What sbatch runs: `sbatch -N 3 launch/slurm/gspo_multi_node.sbatch CONFIG OUTPUT_DIR k=v`
    (no render step), from a spooled copy, so it finds the repository from SLURM_SUBMIT_DIR."""
    env, record = _fake_slurm(tmp_path)
    spooled = tmp_path / "slurm_script"
    shutil.copy(REPO / "launch/slurm/gspo_multi_node.sbatch", spooled)
    out = tmp_path / "run dir"
    proc = subprocess.run(["bash", str(spooled), "configs/qwen3_30b_a3b_gspo_2node.yaml", str(out), "train.steps=10"],
                          capture_output=True, text=True, cwd=tmp_path, env={**env, "GSPO_TRAINER_NODES": "2"},
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    srun = json.loads(record.read_text())
    assert srun["cwd"] == str(REPO) and (out / "logs").is_dir()
    assert srun["args"] == ["--kill-on-bad-exit=1", f"--output={out}/logs/node-%n-%j.out", "launch/node.sh",
                            "configs/qwen3_30b_a3b_gspo_2node.yaml", str(out), "train.steps=10"]
    assert srun["env"]["GSPO_NODES"] == "gpu-a gpu-b gpu-c" and srun["env"]["GSPO_TRAINER_NODES"] == "2"
    assert srun["env"]["MASTER_ADDR"] == "gpu-a" and len(srun["env"]["GSPO_SGLANG_API_KEY"]) == 32
    # Every node trains unless told otherwise; a wrong count and missing arguments are one line.
    subprocess.run(["bash", str(spooled), "c.yaml", str(out)], cwd=tmp_path, env=env, timeout=60, check=True)
    assert json.loads(record.read_text())["env"]["GSPO_TRAINER_NODES"] == "3"
    proc = subprocess.run(["bash", str(spooled), "c.yaml", str(out)], capture_output=True, text=True, cwd=tmp_path,
                          env={**env, "GSPO_TRAINER_NODES": "4"}, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip() == "error: GSPO_TRAINER_NODES=4: must be 1..3 (the job's nodes)"
    proc = subprocess.run(["bash", str(spooled), "c.yaml"], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith("usage: sbatch")


def test_single_node_sbatch_passes_its_arguments_to_the_node_script(tmp_path):
    env, record = _fake_slurm(tmp_path)
    repo = tmp_path / "repo"
    (repo / "launch").mkdir(parents=True)
    (repo / "launch" / "train_8xh100.sh").write_text((tmp_path / "bin" / "srun").read_text())
    (repo / "launch" / "train_8xh100.sh").chmod(0o755)
    proc = subprocess.run(["bash", str(REPO / "launch/slurm/gspo_single_node.sbatch"), "c.yaml", "/runs/x", "a=1"],
                          capture_output=True, text=True, cwd=tmp_path, env={**env, "GSPO_REPO": str(repo)}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    called = json.loads(record.read_text())
    assert called["args"] == ["c.yaml", "/runs/x", "a=1"] and called["cwd"] == str(repo)


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
