"""Process-group setup: the configured seed reaches Megatron's RNG tracker."""

import json

from conftest import run_module

SCRIPT = """
import json, sys
import torch
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from gspo_mcore.config import load_config
from gspo_mcore.models.qwen3_moe.bootstrap import model_from_config

states = {}
for seed in (1, 2, 1):
    config = load_config(None, [f"model.hf_dir={sys.argv[1]}", f"train.seed={seed}"])
    model_from_config(config, load_weights=False)
    tracker = get_cuda_rng_tracker().get_states()
    states.setdefault(seed, []).append({name: state.sum().item() for name, state in tracker.items()})
print(json.dumps({str(k): v for k, v in states.items()}))
"""


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
