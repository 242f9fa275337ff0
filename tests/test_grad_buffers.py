"""optimizer.offload_grad_buffers on a real learner (megatron-core's DDP on the CPU bridge): the fp32
gradient buffers are given back (their storage resized to 0: megatron-core 0.16.1
_ParamAndGradBuffer.offload_to_cpu does the same on CPU as on CUDA) from the learner's build and
between updates, taken again by the update, and the updates are the ones a learner that keeps
its buffers takes, bit for bit. The trainer's order of the calls: tests/test_trainer_loop.py."""

import json

import pytest

from helpers import run_module

pytestmark = pytest.mark.slow  # a learner in a process of its own

# In a process of its own: the learner joins gloo process groups and the CPU bridge patches torch.cuda.
ROUND_TRIP = """
import hashlib, json, sys
import torch
from gspo_mcore.batch.rollout import Batch, Rollout
from gspo_mcore.config import load_config
from gspo_mcore.megatron.learner import Learner

hf_dir, seen = sys.argv[1], {}
# the second batch's responses of 1-4 tokens: its rows padded to the longest
batches = [Batch([Rollout([1, 2, 3], [4, 5, 6, 7 + i + 3 * k][:4 if k == 0 else i + 1], [-0.5] * (4 if k == 0 else i + 1),
                          "stop", "v0") for i in range(4)], [1.0, -1.0, 0.5, -0.5], {}) for k in range(2)]


def sizes(learner):  # each gradient buffer's storage, in elements
    return [b.grad_data.untyped_storage().size() // b.grad_data.element_size()
            for b in learner.ddp.buffers + learner.ddp.expert_parallel_buffers]


def digest(learner):
    h = hashlib.sha256()
    for name, p in sorted(learner.model.named_parameters()):
        h.update(name.encode()), h.update(p.detach().float().numpy().tobytes())
    return h.hexdigest()


for offload in (True, False):
    arm = {}
    config = load_config(None, [f"model.hf_dir={hf_dir}", "weight_sync.colocate=true", "weight_sync.method=disk",
                                f"optimizer.offload_grad_buffers={str(offload).lower()}", "optimizer.lr=0.01",
                                "train.num_minibatches=1"])
    with Learner(config) as learner:
        arm["numel"] = [b.grad_data.numel() for b in learner.ddp.buffers + learner.ddp.expert_parallel_buffers]
        arm["at_build"] = sizes(learner)
        chained = getattr(learner.optimizer, "chained_optimizers", [learner.optimizer])
        arm["fused"] = [g["fused"] for o in chained for g in o.optimizer.param_groups]
        for k, batch in enumerate(batches):
            report = learner.update(batch, step=k)
            arm[f"after_update_{k}"] = sizes(learner)
            main_grad = next(p for p in learner.model.parameters() if p.requires_grad).main_grad
            arm[f"main_grad_finite_{k}"] = bool(torch.isfinite(main_grad).all())
            if offload:  # the trainer's call before the colocated engine resumes
                learner.offload_grad_buffers()
                arm[f"offloaded_{k}"] = sizes(learner)
            arm[f"grad_norm_{k}"], arm[f"digest_{k}"] = report["grad_norm"], digest(learner)
            arm[f"padding_fraction_{k}"] = report["padding_fraction"]
    seen[str(offload).lower()] = arm
print(json.dumps(seen))
"""


def test_the_gradient_buffers_are_given_back_between_updates_and_the_updates_unchanged(tiny_hf_dir, tmp_path):
    script = tmp_path / "round_trip.py"
    script.write_text(ROUND_TRIP)
    seen = json.loads(run_module([str(script), str(tiny_hf_dir)]).stdout.strip().splitlines()[-1])
    given_back, kept = seen["true"], seen["false"]
    numel = kept["numel"]
    assert numel == given_back["numel"] and all(n > 0 for n in numel)
    # Built with them given back (a colocated engine starts beside the learner); kept otherwise.
    assert given_back["at_build"] == [0] * len(numel) and kept["at_build"] == numel
    for k in (0, 1):
        # The update took them again and they hold its gradients; the trainer's call gave them back.
        assert given_back[f"after_update_{k}"] == numel and given_back[f"main_grad_finite_{k}"]
        assert given_back[f"offloaded_{k}"] == [0] * len(numel)
        # The same updates, bit for bit: the second one's gradients came into the restored storage.
        assert given_back[f"grad_norm_{k}"] == kept[f"grad_norm_{k}"] > 0
        assert given_back[f"digest_{k}"] == kept[f"digest_{k}"]
    assert kept["digest_0"] != kept["digest_1"]  # the second update moved the weights
    # equal lengths: no padding; 4-7 tokens in one microbatch of rows of 6 inputs: 4 + 5 + 6 + 6 real of 24
    assert kept["padding_fraction_0"] == 0.0 and kept["padding_fraction_1"] == given_back["padding_fraction_1"] == 3 / 24
    # megatron-core's torch AdamW asked for torch's fused step (fuse_torch_steps), every group
    assert kept["fused"] and all(kept["fused"]) and all(given_back["fused"])
