"""Process-group setup: the configured seed reaches Megatron's RNG tracker."""

import json
import subprocess
import sys

import pytest

from helpers import REPO, environment, run_module

SCRIPT = """
import json, sys
import torch
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from gspo_mcore.config import load_config
from gspo_mcore.megatron.qwen3_moe.bootstrap import model_from_config

states = {}
for seed in (1, 2, 1):
    config = load_config(None, [f"model.hf_dir={sys.argv[1]}", f"train.seed={seed}"])
    model_from_config(config, load_weights=False)
    tracker = get_cuda_rng_tracker().get_states()
    states.setdefault(seed, []).append({name: state.sum().item() for name, state in tracker.items()})
print(json.dumps({str(k): v for k, v in states.items()}))
"""


@pytest.mark.slow  # a script in a subprocess
def test_two_seeds_give_two_tracker_states(tiny_hf_dir, tmp_path):
    """train.seed seeds Megatron's data-, tensor- and expert-parallel RNG states (it was ignored:
    every run used 1234)."""
    script = tmp_path / "seeds.py"
    script.write_text(SCRIPT)
    states = json.loads(run_module([str(script), str(tiny_hf_dir)]).stdout.strip().splitlines()[-1])
    first, again = states["1"]
    (second,) = states["2"]
    assert first == again and set(first) == set(second) and len(first) == 3
    assert all(first[name] != second[name] for name in first), (first, second)


WAITS = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
from gspo_mcore.config import DistributedConfig
from gspo_mcore.megatron.parallel import broadcast_from_host, init_distributed

# 6 s: gloo connects within the group timeout too, and a loaded machine can take seconds
init_distributed(DistributedConfig(timeout_minutes=0.1, rollout_timeout_minutes=1.0), seed=0)
if dist.get_rank() == 0:
    time.sleep(12)  # a rollout twice as long as the trainer's collectives may wait
value = broadcast_from_host({"batch": [1, 2, 3]} if dist.get_rank() == 0 else None)
assert value == {"batch": [1, 2, 3]}
print("host wait ok", flush=True)
if dist.get_rank() == 0:
    time.sleep(12)
try:
    dist.barrier()  # the trainer's own group keeps its short timeout
    print("barrier ok", flush=True)
except Exception as err:
    print("barrier timed out", flush=True)
"""


@pytest.mark.slow
def test_ranks_wait_for_the_rollout_on_the_host_with_their_own_timeout(tmp_path):
    """Rank 0's rollout may outlast the trainer's collective timeout (distributed.timeout_minutes):
    the others wait for the batch in the host group (distributed.rollout_timeout_minutes), not in
    a collective of the trainer's group (on GPUs: an NCCL kernel spinning for the whole rollout)."""
    script = tmp_path / "waits.py"
    script.write_text(WAITS)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(script)], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=environment(warnings=True))
    assert proc.stdout.count("host wait ok") == 2, proc.stdout + proc.stderr[-3000:]
    assert "barrier timed out" in proc.stdout, proc.stdout + proc.stderr[-3000:]
