"""Launch scripts as far as a CPU machine can check them: shellcheck, bash -n, rendered
sbatch scripts (run with stand-ins for srun/scontrol), the wait-for-server / teardown logic against local processes, and the
single-node script end to end with the CPU config (a real SGLang server + the trainer)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import REPO, environment
from gspo_mcore.common.netaddr import free_port

# Slow (`slow` on each): those that run a script, torchrun or SGLang; the static checks (file reads, bash -n,
# shellcheck) are fast.

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


@pytest.mark.slow
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
    assert srun["env"]["MASTER_ADDR"] == "gpu-a" and len(srun["env"]["GSPO_ENGINE_API_KEY"]) == 32
    # Network names are the cluster's: none guessed (ib0 / mlx5 missed DGX H100's ibp* names).
    for name in ("NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_IB_GID_INDEX", "GLOO_SOCKET_IFNAME"):
        assert name not in srun["env"] or srun["env"][name] == os.environ.get(name), name
    # Every node trains unless told otherwise; a wrong count and missing arguments are one line.
    # The user's own network variables reach the nodes as set.
    subprocess.run(["bash", str(spooled), "c.yaml", str(out)], cwd=tmp_path, timeout=60, check=True,
                   env={**env, "NCCL_SOCKET_IFNAME": "ibp12s0", "GLOO_SOCKET_IFNAME": "enp1s0"})
    assert json.loads(record.read_text())["env"]["GSPO_TRAINER_NODES"] == "3"
    assert json.loads(record.read_text())["env"]["NCCL_SOCKET_IFNAME"] == "ibp12s0"
    assert json.loads(record.read_text())["env"]["GLOO_SOCKET_IFNAME"] == "enp1s0"
    proc = subprocess.run(["bash", str(spooled), "c.yaml", str(out)], capture_output=True, text=True, cwd=tmp_path,
                          env={**env, "GSPO_TRAINER_NODES": "4"}, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip() == "error: GSPO_TRAINER_NODES=4: must be 1..3 (the job's nodes)"
    proc = subprocess.run(["bash", str(spooled), "c.yaml"], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith("usage: sbatch")


@pytest.mark.slow
def test_single_node_sbatch_passes_its_arguments_to_the_node_script(tmp_path):
    env, record = _fake_slurm(tmp_path)
    repo = tmp_path / "repo"
    (repo / "launch").mkdir(parents=True)
    (repo / "launch" / "train_8xh100.sh").write_text((tmp_path / "bin" / "srun").read_text())
    (repo / "launch" / "train_8xh100.sh").chmod(0o755)
    shutil.copy(REPO / "launch" / "lib.sh", repo / "launch" / "lib.sh")
    proc = subprocess.run(["bash", str(REPO / "launch/slurm/gspo_single_node.sbatch"), "c.yaml", "/runs/x", "a=1"],
                          capture_output=True, text=True, cwd=tmp_path, env={**env, "GSPO_REPO": str(repo)}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    called = json.loads(record.read_text())
    assert called["args"] == ["c.yaml", "/runs/x", "a=1"] and called["cwd"] == str(repo)


@pytest.mark.slow
@pytest.mark.parametrize("template, trainer", [("gspo_single_node.sbatch", "launch/train_8xh100.sh"),
                                               ("gspo_multi_node.sbatch", "srun")])
def test_the_time_limit_warning_reaches_the_trainer_and_the_job_requeues_after_its_save(tmp_path, template, trainer):
    """Slurm's --signal=B:USR1 goes to the batch shell only: it passes USR1 on (to the single-node
    script, or to srun, which hands it to every node's task), waits until the trainer has saved
    and exited, and only then requeues (a requeue right away would kill the job mid-save)."""
    env, _ = _fake_slurm(tmp_path)
    repo = tmp_path / "repo"
    (repo / "launch").mkdir(parents=True)
    shutil.copy(REPO / "launch" / "lib.sh", repo / "launch" / "lib.sh")
    events = tmp_path / "events"
    # The trainer stand-in: saves for a second on USR1, then exits 138 as gspo_mcore.train does.
    fake = (f"#!/usr/bin/env bash\ntrap 'echo usr1 >> {events}; sleep 1; echo saved >> {events}; exit 138' USR1\n"
            f"echo started >> {events}\nwhile true; do sleep 0.1; done\n")
    target = repo / trainer if "/" in trainer else tmp_path / "bin" / trainer
    target.write_text(fake)
    target.chmod(0o755)
    (tmp_path / "bin" / "scontrol").write_text(
        f"#!/bin/sh\nif [ \"$1\" = requeue ]; then echo \"requeue $2\" >> {events}; else printf 'gpu-a\\n'; fi\n")
    proc = subprocess.Popen(["bash", str(REPO / "launch/slurm" / template), "c.yaml", str(tmp_path / "out")],
                            cwd=tmp_path, env={**env, "GSPO_REPO": str(repo), "SLURM_JOB_NODELIST": "gpu-a"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not (events.is_file() and "started" in events.read_text()):
        assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read() if proc.poll() is not None else ""
        time.sleep(0.1)
    proc.send_signal(signal.SIGUSR1)
    _, stderr = proc.communicate(timeout=30)
    assert events.read_text().splitlines() == ["started", "usr1", "saved", "requeue 4321"], stderr
    assert "requeueing job 4321" in stderr and proc.returncode == 138


@pytest.mark.slow
def test_sbatch_scripts_run_inside_a_pyxis_or_apptainer_container(tmp_path):
    """GSPO_CONTAINER_IMAGE: each node's step runs in the image (pyxis: srun's --container-*
    options; apptainer: `apptainer exec` before the command), the repository and OUTPUT_DIR
    mounted at their own paths, GSPO_CONTAINER_MOUNTS added; a bad runtime is one line."""
    env, record = _fake_slurm(tmp_path)
    out = tmp_path / "run"
    multi = ["bash", str(REPO / "launch/slurm/gspo_multi_node.sbatch"), "c.yaml", str(out), "a=1"]
    image = {"GSPO_CONTAINER_IMAGE": "nvcr.io#org/gspo-mcore:gpu", "GSPO_CONTAINER_MOUNTS": "/models:/models"}
    subprocess.run(multi, cwd=tmp_path, env={**env, **image}, timeout=60, check=True)
    mounts = f"{REPO}:{REPO},{out}:{out},/models:/models"
    assert json.loads(record.read_text())["args"] == [
        "--kill-on-bad-exit=1", f"--output={out}/logs/node-%n-%j.out", "--container-image=nvcr.io#org/gspo-mcore:gpu",
        f"--container-mounts={mounts}", f"--container-workdir={REPO}", "launch/node.sh", "c.yaml", str(out), "a=1"]
    apptainer = {**image, "GSPO_CONTAINER": "apptainer", "GSPO_CONTAINER_IMAGE": "/images/gspo.sif"}
    single = ["bash", str(REPO / "launch/slurm/gspo_single_node.sbatch"), "c.yaml", str(out), "a=1"]
    subprocess.run(single, cwd=tmp_path, env={**env, **apptainer}, timeout=60, check=True)
    assert json.loads(record.read_text())["args"] == [
        "--ntasks=1", "apptainer", "exec", "--nv", "--bind", mounts, "--pwd", str(REPO), "/images/gspo.sif",
        "launch/train_8xh100.sh", "c.yaml", str(out), "a=1"]
    for wrong, message in (({"GSPO_CONTAINER": "docker"}, "GSPO_CONTAINER=docker: expected pyxis or apptainer"),
                           ({"GSPO_CONTAINER": "apptainer", "GSPO_CONTAINER_IMAGE": ""},
                            "GSPO_CONTAINER=apptainer: set GSPO_CONTAINER_IMAGE to the image to run in")):
        for script in (multi, single):
            proc = subprocess.run(script, capture_output=True, text=True, cwd=tmp_path,
                                  env={**env, **image, **wrong}, timeout=60)
            assert proc.returncode == 2 and proc.stderr.strip() == f"error: {message}"


def _bash(script: str, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f"set -euo pipefail; source launch/lib.sh; {script}"], capture_output=True,
                          text=True, cwd=REPO, timeout=timeout)


@pytest.mark.slow
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


@pytest.mark.slow
def test_wait_fails_in_bounded_time_and_on_an_early_exit(tmp_path):
    port = free_port()
    start = time.monotonic()
    proc = _bash(f"gspo_wait_healthy http://127.0.0.1:{port} 2")
    assert proc.returncode == 1 and f"error: server http://127.0.0.1:{port} not healthy after 2s" in proc.stderr
    assert time.monotonic() - start < 10
    proc = _bash(f"trap gspo_teardown EXIT; gspo_start {tmp_path}/x.log {sys.executable} -c 'raise SystemExit(3)'; "
                 f"gspo_wait_healthy http://127.0.0.1:{port} 30 ${{GSPO_PIDS[0]}}")
    assert proc.returncode == 1 and "exited while starting" in proc.stderr


@pytest.mark.slow
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


@pytest.mark.slow
def test_single_node_script_end_to_end_on_cpu(tmp_path):
    """launch/train_8xh100.sh with the CPU config, split mode on a pretend 2-GPU node: the
    planner's layout, a real SGLang server on the first 'GPU', the trainer on the second."""
    from gspo_mcore.tasks.toy import make_toy_task

    toy = make_toy_task(tmp_path / "toy", seed=0)
    out = tmp_path / "run"
    env = environment(GSPO_PYTHON=sys.executable, GSPO_GPUS_PER_NODE="2", GSPO_BASE_PORT=str(free_port()),
                      GSPO_SERVER_TIMEOUT="300")
    proc = subprocess.run(["launch/train_8xh100.sh", "configs/tiny_cpu.yaml", str(out), f"model.hf_dir={toy}/model",
                           f"data.path={toy}/prompts.jsonl", "eval.datasets=[]", "train.steps=1", "train.save_every=0",
                           "train.export_hf=false", "weight_sync.check_every=1"],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trainer on GPUs 1" in proc.stderr
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1
    assert (out / "logs" / "sglang_0.log").stat().st_size > 0
    assert list((out / "logs" / "torchrun").rglob("stdout.log"))


@pytest.mark.slow
def test_convert_script_on_a_small_checkpoint(tmp_path):
    """launch/convert_qwen3_30b.sh as a user runs it (conversion + verify), on the toy model."""
    from gspo_mcore.megatron.qwen3_moe.tiny import make_tiny_checkpoint

    hf = make_tiny_checkpoint(tmp_path / "hf", seed=0)
    env = environment(GSPO_PYTHON=sys.executable)
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


@pytest.mark.slow
def test_multi_node_split_rollout_node_stops_when_training_ends(tmp_path):
    """launch/node.sh with a trainer node and a rollout node (two 'nodes' on this machine): the
    rollout node serves, the trainer node trains against it over the API key, and when training
    has ended the rollout node stops its server and exits 0 (it used to serve forever, keeping
    the Slurm step alive)."""
    from gspo_mcore.tasks.toy import make_toy_task

    toy = make_toy_task(tmp_path / "toy", seed=0)
    out = tmp_path / "run"
    env = environment(GSPO_PYTHON=sys.executable, GSPO_GPUS_PER_NODE="1", GSPO_NODES="127.0.0.1 localhost",
                      GSPO_TRAINER_NODES="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                      GSPO_BASE_PORT=str(free_port()), GSPO_SERVER_TIMEOUT="300", GSPO_ENGINE_API_KEY="split-key")
    args = ["launch/node.sh", "configs/tiny_cpu.yaml", str(out), f"model.hf_dir={toy}/model",
            f"data.path={toy}/prompts.jsonl", "eval.datasets=[]", "train.steps=1", "train.save_every=0", "train.export_hf=false",
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


@pytest.mark.slow
def test_multi_node_script_reports_the_planners_own_error(tmp_path, tiny_hf_dir):
    """A layout the planner refuses stops node.sh with the planner's one-line error (it used to
    surface later as 'unbound variable')."""
    env = environment(warnings=True, GSPO_PYTHON=sys.executable, GSPO_GPUS_PER_NODE="1", GSPO_NODES="127.0.0.1",
                      GSPO_TRAINER_NODES="1", GSPO_NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1",
                      GSPO_ENGINE_API_KEY="k")
    proc = subprocess.run(["launch/node.sh", "configs/tiny_cpu.yaml", str(tmp_path / "run"),
                           f"model.hf_dir={tiny_hf_dir}"], capture_output=True,
                          text=True, cwd=REPO, env=env, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: rollout: 1 servers x engine_tp 1 = 1 GPUs"), proc.stderr
    assert "unbound variable" not in proc.stderr


def _stand_in(tmp_path: Path, name: str, output: str) -> dict:
    """An environment whose PATH starts with a `name` that prints `output`."""
    import tempfile

    bin_dir = Path(tempfile.mkdtemp(dir=tmp_path, prefix="bin-"))
    (bin_dir / name).write_text(f"#!/bin/sh\ncat <<'OUT'\n{output}\nOUT\n")
    (bin_dir / name).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


EXCLUSIVE = """==============NVSMI LOG==============
Attached GPUs                             : 2
GPU 00000000:18:00.0
    Compute Mode                          : Default
GPU 00000000:2A:00.0
    Compute Mode                          : Exclusive_Process"""


@pytest.mark.slow
def test_compute_mode_check_in_lib(tmp_path):
    def check(env):
        return subprocess.run(["bash", "-c", "source launch/lib.sh; gspo_check_compute_mode"], capture_output=True,
                              text=True, cwd=REPO, env=env, timeout=30)

    assert shutil.which("nvidia-smi") is None  # none here: the check has nothing to ask
    assert check(os.environ).returncode == 0
    assert check(_stand_in(tmp_path, "nvidia-smi", EXCLUSIVE.replace("Exclusive_Process", "Default"))).returncode == 0
    proc = check(_stand_in(tmp_path, "nvidia-smi", EXCLUSIVE))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "error: GPU compute mode is Exclusive_Process, but weight_sync.colocate" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("script", ["train_8xh100.sh", "node.sh"])
def test_colocated_launch_refuses_an_exclusive_process_gpu(tmp_path, tiny_hf_dir, script):
    """A stand-in nvidia-smi reporting Exclusive_Process: the colocated launch stops in one line,
    exit 2, before any server starts; the same GPUs pass a split config."""
    env = {**_stand_in(tmp_path, "nvidia-smi", "    Compute Mode                          : Exclusive_Process"),
           "GSPO_PYTHON": sys.executable, "GSPO_GPUS_PER_NODE": "1", "PYTHONPATH": str(REPO), "GSPO_NODES": "127.0.0.1",
           "GSPO_TRAINER_NODES": "1", "GSPO_NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1",
           "GSPO_ENGINE_API_KEY": "k"}
    out = tmp_path / "run"
    proc = subprocess.run([f"launch/{script}", "configs/tiny_cpu.yaml", str(out), f"model.hf_dir={tiny_hf_dir}",
                           "weight_sync.colocate=true", "weight_sync.method=tensor"], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "error: GPU compute mode is Exclusive_Process" in proc.stderr.strip().splitlines()[-1]
    assert not list(out.rglob("sglang_*.log"))


@pytest.mark.slow
def test_smoke_script_needs_a_gpu(tmp_path):
    """No nvidia-smi (this machine), or one but a torch without CUDA: one line, exit 2, nothing written."""
    env = {**os.environ, "GSPO_PYTHON": sys.executable}
    for variables in (env, {**_stand_in(tmp_path, "nvidia-smi", EXCLUSIVE), "GSPO_PYTHON": sys.executable}):
        proc = subprocess.run(["launch/smoke_1gpu.sh", str(tmp_path / "smoke")], capture_output=True, text=True,
                              cwd=REPO, env=variables, timeout=120)
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr.strip() == ("error: launch/smoke_1gpu.sh needs a CUDA GPU "
                                       "(nvidia-smi and torch.cuda.is_available())")
        assert not (tmp_path / "smoke").exists()


def _smoke_parts() -> tuple[dict[str, list[str]], list[str]]:
    """The smoke script's override arrays (as bash expands them, WORK_DIR = /w) and its verdict programs."""
    import re

    text = (REPO / "launch/smoke_1gpu.sh").read_text()
    arrays = {}
    for name in ("toy", "memory"):
        definition = re.search(rf"^{name}=\(.*?\)\n", text, re.S | re.M).group(0)
        proc = subprocess.run(["bash", "-c", f'work=/w\n{definition}printf "%s\\0" "${{{name}[@]}}"'],
                              capture_output=True, text=True, check=True)
        arrays[name] = proc.stdout.split("\0")[:-1]
    return arrays, re.findall(r"<<'EOF'\n(.*?)\nEOF\n", text, re.S)


def _verdict(program: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-", *map(str, args)], input=program, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.slow
def test_smoke_configs_plan_on_one_gpu_and_its_verdicts(tmp_path):
    """What CPU can check of launch/smoke_1gpu.sh: its two runs' overrides load and the planner
    fits them on one H100 (colocated); each verdict program passes good figures and fails bad
    ones in one line."""
    from checkpoint_convert.synthetic import QWEN3_30B_A3B
    from gspo_mcore.config import load_config
    from gspo_mcore.megatron.qwen3_moe.hf_config import load_hf_config, parse_hf_config
    from gspo_mcore.planner.cli import plan
    from gspo_mcore.tasks.toy import make_toy_task

    arrays, (parity, colocated, memory) = _smoke_parts()
    toy = make_toy_task(tmp_path / "toy", seed=0)
    config = REPO / "configs/qwen3_30b_a3b_gspo.yaml"
    fits = plan(load_config(config, [*arrays["toy"], "train.steps=2"]), load_hf_config(toy / "model"), 1, 1, 79.6, 16)
    assert fits["margin_gb"] > 60 and tuple(fits["phases_gb"]) == ("training", "weight push", "sync check", "rollout")
    synthetic = parse_hf_config({**QWEN3_30B_A3B, "num_hidden_layers": 2})
    estimate = plan(load_config(config, arrays["memory"]), synthetic, 1, 1, 79.6, 16)
    assert estimate["trainer_total_gb"] > 19 and estimate["margin_gb"] > 0  # real widths at a 16k budget

    good = {"max_abs_logit_diff": 1.4, "mean_abs_logit_diff": 0.019, "top1_agreement": 0.965, "logit_std": 1.0,
            "export_bitwise_identical": True}  # this CPU's bf16 figures, local spec
    assert _verdict(parity, json.dumps(good)).stdout.startswith("PASS 1/3 TE parity")
    wrong = _verdict(parity, json.dumps({**good, "mean_abs_logit_diff": 0.9, "top1_agreement": 0.01}))
    assert wrong.returncode == 1 and wrong.stdout.startswith("FAIL 1/3") and len(wrong.stdout.splitlines()) == 1
    assert _verdict(parity, "").stdout.startswith("FAIL 1/3 TE parity: no figures")

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "sync_check_median": 0.004, "peak_memory_gb": 20.0}) + "\n"
                               for s in (1, 2, 3)))
    assert _verdict(colocated, metrics).stdout.startswith("PASS 2/3 colocated")
    assert _verdict(memory, json.dumps(estimate), metrics, "FusedAttention").stdout.startswith(
        "PASS 3/3 memory (2 layers at Qwen3-30B-A3B widths, 16k tokens): attention FusedAttention; trainer peak 20.0 GiB")
    over = tmp_path / "over.jsonl"
    over.write_text(json.dumps({"step": 1, "peak_memory_gb": estimate["trainer_total_gb"] + 5}) + "\n")
    assert _verdict(colocated, over).returncode == 1
    # Within the planner's stated tolerance (1.5x) a peak above the estimate passes; beyond it, not.
    assert _verdict(memory, json.dumps(estimate), over, "x").stdout.startswith("PASS 3/3")
    over.write_text(json.dumps({"step": 1, "peak_memory_gb": estimate["trainer_total_gb"] * 1.6}) + "\n")
    assert _verdict(memory, json.dumps(estimate), over, "x").stdout.startswith("FAIL 3/3")
    over.write_text(json.dumps({"step": 1}) + "\n")
    assert "trainer peak not in metrics.jsonl" in _verdict(memory, json.dumps(estimate), over, "x").stdout


def test_torchrun_gloo_interface_is_the_one_routing_to_the_rendezvous():
    import psutil
    import socket

    from gspo_mcore.run.torchrun import gloo_interface, interface_towards

    holding = {a.address: name for name, addresses in psutil.net_if_addrs().items() for a in addresses
               if a.family == socket.AF_INET}
    assert interface_towards("127.0.0.1") == holding["127.0.0.1"]  # loopback routes over its own interface
    assert gloo_interface("127.0.0.1") is None and gloo_interface(None) is None  # one node: gloo's default
    assert gloo_interface("no-such-host.invalid") is None
    for address, name in holding.items():
        if not address.startswith("127."):
            assert interface_towards(address) == name and gloo_interface(address) == name
    from torch.distributed.run import parse_args

    from gspo_mcore.run.torchrun import rendezvous_host

    assert rendezvous_host(parse_args(["--standalone", "x.py"])) is None
    assert rendezvous_host(parse_args(["--rdzv-backend", "c10d", "--rdzv-endpoint", "gpu-a:29400", "x.py"])) == "gpu-a"
    assert rendezvous_host(parse_args(["--rdzv-endpoint", "[fe80::1]:5", "--rdzv-backend", "c10d", "x.py"])) == "fe80::1"
    assert rendezvous_host(parse_args(["--nnodes", "2", "--master-addr", "gpu-b", "x.py"])) == "gpu-b"


# One write per rank (a line under PIPE_BUF is atomic): print() may write the JSON and its newline
# separately (PYTHONUNBUFFERED), and two ranks' lines then interleave on the shared pipe.
PROBE_ENV = """
import json, os
line = json.dumps({k: os.environ.get(k) for k in ("GLOO_SOCKET_IFNAME", "OMP_NUM_THREADS")}) + "\\n"
os.write(1, line.encode())
"""


@pytest.mark.slow
def test_torchrun_sets_the_gloo_interface_and_omp_threads_the_user_did_not(tmp_path):
    import psutil
    import socket

    from gspo_mcore.common.netaddr import free_port

    probe = tmp_path / "probe.py"
    probe.write_text(PROBE_ENV)
    cores = len(os.sched_getaffinity(0))
    env = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "OMP_NUM_THREADS")}
    env.update(PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")

    def workers(args, **extra):
        proc = subprocess.run([sys.executable, "-m", "gspo_mcore.run.torchrun", *args, str(probe)], capture_output=True,
                              text=True, env={**env, **extra}, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]

    assert workers(["--standalone", "--nproc_per_node", "2"]) == [
        {"GLOO_SOCKET_IFNAME": None, "OMP_NUM_THREADS": str(max(1, cores // 2))}] * 2
    assert workers(["--standalone", "--nproc_per_node", "1"], OMP_NUM_THREADS="7") == [
        {"GLOO_SOCKET_IFNAME": None, "OMP_NUM_THREADS": "7"}]
    others = [(a.address, name) for name, addresses in psutil.net_if_addrs().items() for a in addresses
              if a.family == socket.AF_INET and not a.address.startswith("127.")]
    if not others:
        pytest.skip("no non-loopback IPv4 interface for a rendezvous address")
    address, name = others[0]
    # static rendezvous: node 0 hosts the store at MASTER_ADDR (c10d hosts it only when the
    # endpoint matches the host name's addresses, which a secondary interface may not)
    rendezvous = ["--nnodes", "1", "--node-rank", "0", "--nproc_per_node", "1", "--master-addr", address,
                  "--master-port", str(free_port())]
    assert workers(rendezvous) == [{"GLOO_SOCKET_IFNAME": name, "OMP_NUM_THREADS": str(cores)}]
    assert workers(rendezvous, GLOO_SOCKET_IFNAME="lo")[0]["GLOO_SOCKET_IFNAME"] == "lo"  # the user's choice stays


def test_docker_context_leaves_out_local_state_and_the_image_has_no_apex():
    ignored = set((REPO / ".dockerignore").read_text().split())
    assert {".venv", "outputs", "runs", ".git", "**/__pycache__", "**/*.egg-info", "**/.pytest_cache"} <= ignored
    assert "apex" not in "\n".join(line for line in (REPO / "Dockerfile").read_text().splitlines()
                                     if not line.lstrip().startswith("#"))


def test_the_image_builds_for_h100_only_and_imports_no_transformer_engine_at_build_time():
    """Unset, NVTE_CUDA_ARCHS compiles Transformer Engine for six architectures; TE's import
    loads libcuda, which a docker build has no driver for."""
    import re

    docker = (REPO / "Dockerfile").read_text()
    assert re.search(r"^ARG NVTE_CUDA_ARCHS=90$", docker, re.M) and "NVTE_CUDA_ARCHS=${NVTE_CUDA_ARCHS}" in docker
    runs = " ".join(line for line in docker.splitlines() if not line.lstrip().startswith("#"))
    assert not re.search(r"import [^\"]*\btransformer_engine\b", runs)


def test_the_smoke_memory_check_holds_the_planner_to_its_stated_tolerance():
    from gspo_mcore.planner.cli import ESTIMATE_TOLERANCE

    script = (REPO / "launch" / "smoke_1gpu.sh").read_text()
    assert 'max(peaks) <= planned * tolerance' in script and 'plan["estimate_tolerance"]' in script
    assert "27 GB" not in script and ESTIMATE_TOLERANCE == 1.5


def test_the_image_carries_vllm_in_its_own_python_and_the_vllm_configs_name_it():
    """vLLM 0.33 pins another torch, fastapi and xgrammar than SGLang's image: its own environment
    (/opt/vllm), which every GPU config on vLLM names as rollout.engine_python."""
    import re

    import yaml

    docker = (REPO / "Dockerfile").read_text()
    assert re.search(r"^ARG VLLM_VERSION=0\.33\.\d+$", docker, re.M) and "/opt/vllm/bin/python" in docker
    vllm_configs = [p for p in (REPO / "configs").glob("qwen3_*.yaml")
                    if (yaml.safe_load(p.read_text()).get("rollout") or {}).get("engine") == "vllm"]
    assert len(vllm_configs) >= 2
    for path in vllm_configs:
        assert yaml.safe_load(path.read_text())["rollout"]["engine_python"] == "/opt/vllm/bin/python", path


def test_the_api_key_is_the_engines_and_its_old_name_is_still_read(monkeypatch):
    """GSPO_ENGINE_API_KEY (either engine); a job script of an earlier version exporting
    GSPO_SGLANG_API_KEY still reaches the run; the new name wins when both are set."""
    from gspo_mcore.common.http import api_key_from_env

    monkeypatch.delenv("GSPO_ENGINE_API_KEY", raising=False)
    monkeypatch.setenv("GSPO_SGLANG_API_KEY", "old")
    assert api_key_from_env() == "old"
    monkeypatch.setenv("GSPO_ENGINE_API_KEY", "new")
    assert api_key_from_env() == "new"
    for script in ("launch/train_8xh100.sh", "launch/node.sh", "launch/slurm/gspo_multi_node.sbatch"):
        assert "GSPO_ENGINE_API_KEY" in (REPO / script).read_text(), script


@pytest.mark.slow
def test_multi_node_servers_listen_on_their_nodes_address_not_on_every_interface(tmp_path, tiny_hf_dir):
    """launch/node.sh on a rollout node: each server listens on the address the trainer's URLs
    name (launch/addresses.py), never 0.0.0.0 (where a colocated vLLM's pickled IPC handles and
    the dev routes --api-key does not cover would reach anyone reaching the port)."""
    recorded, out, port = tmp_path / "serve_args", tmp_path / "run", str(free_port())
    done = out / "logs" / f"training_done.{port}"
    python = tmp_path / "python"  # its server records its arguments, then training ends (the node stops)
    python.write_text(f'#!/usr/bin/env bash\nif [[ "$1 $2" == "-m gspo_mcore.engines.serve" ]]; then '
                      f'echo "$@" >> {recorded}; touch {done}; exec sleep 60; fi\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    env = environment(warnings=True, GSPO_PYTHON=str(python), GSPO_GPUS_PER_NODE="1", GSPO_NODES="127.0.0.1 localhost",
                      GSPO_TRAINER_NODES="1", GSPO_NODE_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                      GSPO_ENGINE_API_KEY="k")
    env.pop("SLURM_JOB_ID", None)
    proc = subprocess.run(["launch/node.sh", "configs/tiny_cpu.yaml", str(out), f"model.hf_dir={tiny_hf_dir}"],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    args = recorded.read_text().split()
    assert args[args.index("--host") + 1] == "127.0.0.1"
    assert not any("0.0.0.0" in p.read_text() for p in SCRIPTS)


def test_a_nodes_address_is_the_name_services_and_never_its_own_loopback(monkeypatch):
    """Every node resolves every name the same way, except its own name on a Debian-style host
    (127.0.1.1): that node takes the address it sends from towards the others. One node alone
    stays on loopback."""
    sys.path.insert(0, str(REPO / "launch"))
    try:
        import addresses
    finally:
        sys.path.remove(str(REPO / "launch"))
    names = {"node-a": "127.0.1.1", "node-b": "10.0.0.2", "solo": "127.0.1.1"}
    monkeypatch.setattr(addresses, "resolve", names.__getitem__)
    monkeypatch.setattr(addresses, "address_towards", lambda peer: {"10.0.0.2": "10.0.0.1"}[peer])
    assert addresses.node_addresses(["node-a", "node-b"]) == ["10.0.0.1", "10.0.0.2"]
    assert addresses.node_addresses(["solo"]) == ["127.0.1.1"]
