"""Learner.close gives back what a learner holds (GPU round 5, G4: a dropped learner kept 21.7 GB of
an H100, a second 30.3 GB, the third ran out of memory), and a config a machine cannot run is
refused before the learner builds anything."""

import json
import sys

import pytest

from helpers import run_module

# In a process of its own: the learner joins gloo process groups and the CPU bridge patches torch.cuda.
CLOSED = """
import gc, json, sys, weakref
from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.moe.router_replay import RouterReplay
import torch.distributed as dist
from gspo_mcore.batch.rollout import Batch, Rollout
from gspo_mcore.config import load_config
from gspo_mcore.megatron.learner import Learner
from gspo_mcore.megatron.parallel import model_parallel_groups

hf_dir, seen = sys.argv[1], {}
# A policy and a reference (loss.kl_loss_coef), one GSPO update: DDP's hooks, the gradient
# buffers, Adam's moments, the rotary cache and the autograd graphs of a training forward all exist.
learner = Learner(load_config(None, [f"model.hf_dir={hf_dir}", "loss.kl_loss_coef=0.01"]))
rollouts = [Rollout([1, 2, 3], [4, 5, 6, 7 + i], [-0.5] * 4, "stop", "v0") for i in range(4)]
learner.update(Batch(rollouts, [1.0, -1.0, 0.5, -0.5], {}), step=0)
states = [s for inner in learner.optimizer.chained_optimizers for s in inner.optimizer.state.values()]
held = {"model": learner.model, "parameter": next(learner.model.parameters()), "ddp": learner.ddp,
        "optimizer": learner.optimizer, "adam_moment": states[0]["exp_avg"], "reference": learner.reference,
        "expert_weight": next(p for n, p in learner.model.named_parameters() if ".experts." in n),
        "grad_buffer": learner.ddp.buffers[0].grad_data}
refs = {name: weakref.ref(obj) for name, obj in held.items()}
groups = model_parallel_groups()
seen["rotary_cached_before"] = RotaryEmbedding.forward.cache_info().currsize
del held, states
learner.close()
learner.close()  # idempotent
del learner
gc.collect()
seen["alive"] = sorted(name for name, ref in refs.items() if ref() is not None)
seen["rotary_cached"] = RotaryEmbedding.forward.cache_info().currsize
seen["parallel_state"] = parallel_state.model_parallel_is_initialized()
seen["memory_buffer"] = parallel_state._GLOBAL_MEMORY_BUFFER is not None
seen["groups_left"] = sum(g in dist.distributed_c10d._world.pg_map for g in groups)

# A learner of the caller's groups (the trainer's way: `arch` given): its groups stay theirs.
from gspo_mcore.megatron.qwen3_moe.bootstrap import join_process_groups
config = load_config(None, [f"model.hf_dir={hf_dir}", "train.routing_replay=true",
                            "rollout.return_routed_experts=true"])
with Learner(config, join_process_groups(config)) as learner:
    seen["replay_instances_before"] = len(RouterReplay.global_router_replay_instances)
    model = weakref.ref(learner.model)
gc.collect()
seen["second_alive"] = model() is not None
seen["replay_instances"] = len(RouterReplay.global_router_replay_instances)
seen["second_parallel_state"] = parallel_state.model_parallel_is_initialized()
seen["second_memory_buffer_empty"] = not parallel_state.get_global_memory_buffer().buffer
print(json.dumps(seen))
"""


@pytest.mark.slow  # a Python of its own builds and drops the learners (~8 s of CPU)
def test_a_closed_learner_is_collected_with_what_it_filled(tiny_hf_dir, tmp_path):
    """After close and `del`, nothing keeps the model, its parameters, DDP, the gradient buffer, the
    optimizer and its moments or the reference model (DDP's hooks on the gradient accumulators held
    them: on today's megatron-core a dropped learner is never collected); the process-wide caches it
    filled are empty; the process groups it joined are destroyed, and those a caller joined stay."""
    script = tmp_path / "closed.py"
    script.write_text(CLOSED)
    seen = json.loads(run_module([str(script), str(tiny_hf_dir)]).stdout.strip().splitlines()[-1])
    assert seen["alive"] == [], seen
    assert seen["rotary_cached_before"] > 0 and seen["rotary_cached"] == 0
    assert not seen["parallel_state"] and not seen["memory_buffer"] and seen["groups_left"] == 0
    assert not seen["second_alive"] and seen["replay_instances_before"] == 3 and seen["replay_instances"] == 0
    assert seen["second_parallel_state"] and seen["second_memory_buffer_empty"]


def test_the_precision_aware_refusal_comes_before_the_model(monkeypatch):
    """Without Transformer Engine, Learner refuses optimizer.precision_aware before it builds or
    joins anything (the refusal from Megatron's OptimizerConfig came after the model and DDP)."""
    from gspo_mcore.config import ConfigError, load_config
    from gspo_mcore.megatron import learner

    def built(*args, **kwargs):
        raise AssertionError("the model was built")

    monkeypatch.setattr(learner, "model_from_config", built)
    monkeypatch.setitem(sys.modules, "transformer_engine", None)
    config = load_config(None, ["distributed.device=cuda", "model.dtype=bfloat16", "optimizer.precision_aware=true"])
    with pytest.raises(ConfigError, match=r"^optimizer.precision_aware: needs Transformer Engine's FusedAdam"):
        learner.Learner(config)
