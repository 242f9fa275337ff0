"""What an optimizer step allocates, for each optimizer the trainer builds (gspo_mcore.planner.
memory_model.optimizer_step_bytes): torch's foreach Adam copies the second moments of a whole
param group (4 bytes a parameter of the largest), the fused step nothing, which is what
gspo_mcore.megatron.optimizer.fuse_torch_steps asks for; Transformer Engine's FusedAdam (bf16
moments) holds fp32 copies of a group's moments (8 bytes a parameter), which step_chunks bounds
to one chunk. Measured on CPU with the rehearsal's count of real storages."""

import inspect
from types import SimpleNamespace

import pytest
import torch

import megatron.core.optimizer as megatron_optimizer
from gspo_mcore.config import ConfigError, load_config
from gspo_mcore.megatron.optimizer import fuse_torch_steps
from gspo_mcore.megatron.step_chunks import STEP_CHUNK_PARAMS, _chunks, step_groups_in_chunks
from gspo_mcore.planner.memory_model import Layout, optimizer_step_bytes
from gspo_mcore.rehearsal.memory import Counter, RealCounting


def step_transient(optimizer) -> int:
    """Bytes a step allocated beyond what was live before it, at its peak: the second of two steps
    counted (the first registers what persists: the count starts from the storages it saw made)."""
    counter = Counter("cpu")
    with RealCounting(counter):
        optimizer.step()
        counter.reset_peak()
        before = counter.live
        optimizer.step()
    return counter.peak.bytes - before


def adamw_in_megatrons_groups(sizes=(300_000, 200_000, 100_000), small=(1000, 1000)):
    """A decay group of `sizes` and a no-decay group of `small` (biases, norms), gradients set, one
    step taken (the state made)."""
    torch.manual_seed(0)
    decay = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    no_decay = [torch.nn.Parameter(torch.randn(n)) for n in small]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=1e-3)
    for p in decay + no_decay:
        p.grad = torch.randn_like(p)
    return optimizer


def test_megatrons_torch_adam_would_take_the_foreach_step_which_copies_the_largest_group():
    """megatron-core 0.16.1 builds torch's AdamW from (params, lr, weight_decay, betas, eps): no
    `fused`, no `foreach` (torch then takes foreach on CUDA). That step holds an fp32 copy of the
    second moments of the largest group (4 bytes a parameter); the fused step holds nothing."""
    source = inspect.getsource(megatron_optimizer._get_megatron_optimizer_based_on_param_groups)
    assert "optimizer = adam_cls(**kwargs)" in source and "fused" not in source.split("adam_cls(**kwargs)")[0][-600:]
    foreach = adamw_in_megatrons_groups()
    for group in foreach.param_groups:
        group["foreach"] = True
    foreach.step()
    assert step_transient(foreach) == 4 * 600_000  # the decay group's, not both groups'
    fused = adamw_in_megatrons_groups()
    fuse_torch_steps(SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=fused)]))
    fused.step()
    assert step_transient(fused) == 0


def test_fuse_torch_steps_takes_torchs_adam_and_sgd_only_and_a_load_keeps_them_fused():
    """Each chained torch Adam / AdamW / SGD asks for the fused step; another optimizer (TE's
    FusedAdam, the host-offload one) is left as built; a checkpoint saved before (its groups
    without `fused`) loads fused again, and its steps are equal to an unfused optimizer's."""
    adamw, sgd = adamw_in_megatrons_groups(), torch.optim.SGD([torch.nn.Parameter(torch.ones(4))], lr=0.1,
                                                              momentum=0.9)
    other = SimpleNamespace(param_groups=[{"params": []}])
    fuse_torch_steps(SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=o) for o in (adamw, sgd, other)]))
    assert [g["fused"] for g in adamw.param_groups + sgd.param_groups] == [True, True, True]
    assert "fused" not in other.param_groups[0]
    reference = adamw_in_megatrons_groups()
    for _ in range(2):
        reference.step(), adamw.step()
    saved = reference.state_dict()  # groups with fused=None: a checkpoint of an unfused optimizer
    adamw.load_state_dict(saved)
    assert [(g["fused"], g["foreach"]) for g in adamw.param_groups] == [(True, False), (True, False)]
    reference.step(), adamw.step()
    for a, b in zip(reference.param_groups[0]["params"], adamw.param_groups[0]["params"]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


class GroupCopyingAdam(torch.optim.Optimizer):
    """A stand-in with Transformer Engine's FusedAdam's shape of step (fused_adam.py): a per-group
    `step` count in the group dict; bf16 moments, each unscaled to an fp32 copy kept for the whole
    group until its kernel ran, then written back."""

    def __init__(self, params, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.capturable = False

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            beta1, beta2 = group["betas"]
            unscaled = []
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16)
                unscaled.append((p, state, state["exp_avg"].float(), state["exp_avg_sq"].float()))
            for p, state, m, v in unscaled:
                m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                correction1, correction2 = 1 - beta1 ** group["step"], 1 - beta2 ** group["step"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                denominator = v.sqrt().div_(correction2 ** 0.5).add_(group["eps"])  # one tensor's temporary
                p.addcdiv_(m, denominator, value=-group["lr"] / correction1)
            for p, state, m, v in unscaled:
                state["exp_avg"].copy_(m), state["exp_avg_sq"].copy_(v)


def two_groups(seed=0):
    torch.manual_seed(seed)
    big = [torch.nn.Parameter(torch.randn(n)) for n in (40_000, 30_000, 20_000, 10_000)]
    small = [torch.nn.Parameter(torch.randn(100))]
    for p in big + small:
        p.grad = torch.randn_like(p)
    return GroupCopyingAdam([{"params": big}, {"params": small, "weight_decay": 0.0}])


def test_a_group_copying_step_taken_in_chunks_is_the_same_update_with_one_chunks_transient():
    """Three steps of the whole groups and of 45k-parameter chunks: bitwise the same weights and
    moments, the group's count stepped once a step; the transient 8 bytes a parameter of the
    largest chunk, not of the group (+ the stand-in's own temporary of one tensor, 4 bytes an
    element of the largest); a capturable optimizer is refused."""
    whole, chunked = two_groups(), two_groups()
    step_groups_in_chunks(chunked, 45_000)
    whole.step(), chunked.step()
    assert step_transient(whole) >= 8 * 100_000
    assert 8 * 40_000 <= step_transient(chunked) <= 8 * 45_000 + 4 * 40_000
    for a, b in zip(whole.param_groups, chunked.param_groups):
        assert a["step"] == b["step"] == 3
        for p, q in zip(a["params"], b["params"]):
            assert torch.equal(p, q)
            assert torch.equal(whole.state[p]["exp_avg_sq"], chunked.state[q]["exp_avg_sq"])
    assert [len(g["params"]) for g in chunked.param_groups] == [4, 1]  # the groups as megatron keeps them
    assert [[p.numel() for p in run] for run in _chunks(chunked.param_groups[0]["params"], 45_000)] == [
        [40_000], [30_000], [20_000, 10_000]]
    capturable = two_groups()
    capturable.capturable = True
    with pytest.raises(ConfigError, match="capturable"):
        step_groups_in_chunks(capturable, 45_000)


def test_the_planner_counts_the_step_of_the_optimizer_built():
    """GPU Adam (fused) and an offloaded optimizer: nothing on the GPU; the precision-aware one: 8
    bytes a parameter of its largest group, at most one chunk's (the 30B config's expert group at
    EP 8 is 3.6B parameters)."""
    from gspo_mcore.megatron.qwen3_moe.hf_config import load_hf_config
    from helpers import HF_30B, REPO

    arch = load_hf_config(HF_30B)
    layout = Layout(total_gpus=8, trainer_gpus=8, rollout_gpus=0, dp=8, expert_dp=1)
    aware = load_config(REPO / "configs/qwen3_30b_a3b_gspo.yaml")
    assert aware.optimizer.precision_aware
    assert optimizer_step_bytes(aware, arch, layout) == 8 * STEP_CHUNK_PARAMS == 2 * 2**30
    for overrides in (["optimizer.precision_aware=false"], ["optimizer.precision_aware=false",
                                                            "optimizer.cpu_offload=true"]):
        config = load_config(REPO / "configs/qwen3_30b_a3b_gspo.yaml", overrides)
        assert optimizer_step_bytes(config, arch, layout) == 0
