import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# Parallel layouts the model must be exact under: name -> (processes, config overrides).
LAYOUTS = {
    "single": (1, []),
    "EP2": (2, ["distributed.expert_parallel=2"]),
    "PP2": (2, ["distributed.pipeline_parallel=2"]),
    # ETP=1: experts unsplit and replicated over the TP ranks, each running its own tokens.
    "TP2-SP": (2, ["distributed.tensor_parallel=2"]),
    "TP2-SP-ETP2": (2, ["distributed.tensor_parallel=2", "distributed.expert_tensor_parallel=2"]),
    "DP2": (2, []),
}


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory) -> Path:
    """A random tiny Qwen3-MoE (float32) in Hugging Face format."""
    from gspo_mcore.models.qwen3_moe.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_hf"), seed=0)


def run_module(args: list[str], nproc: int = 1, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run `python -m ...` (nproc 1) or `torchrun --nproc_per_node N -m ...`; fail with its log."""
    if nproc == 1:
        cmd = [sys.executable, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
               *args]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def last_json_line(text: str) -> dict:
    return json.loads([line for line in text.splitlines() if line.startswith("{")][-1])
