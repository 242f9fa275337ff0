"""The rehearsal (gspo_mcore.rehearsal): the routing plan and the FLOPs by kind as pure functions;
the fake device's process-level checks (planted GPU-only slips named at their lines); every GPU
config's step rehearsed at the 30B widths with 2 layers (slow), its FLOPs equal to the planner's."""

import json
import subprocess
import sys

import pytest

from helpers import REPO, environment
from gspo_mcore.config import load_config
from gspo_mcore.megatron.qwen3_moe.hf_config import load_hf_config
from gspo_mcore.planner.flops import flops_by_kind, update_flops
from gspo_mcore.planner.memory_model import EXPERT_IMBALANCE, expert_imbalance
from gspo_mcore.rehearsal.plan import RoutingPlan, spread

HF_30B = REPO / "configs/hf/qwen3-30b-a3b.config.json"
HF_235B = REPO / "configs/hf/qwen3-235b-a22b.config.json"


def test_spread_sums_and_stays_even():
    assert spread(10, 4) == [3, 3, 2, 2]
    assert sum(spread(262_143, 8)) == 262_143


@pytest.mark.parametrize("ep, imbalance", [(8, 2.0), (8, 1.0), (4, 3.0), (1, 2.0)])
def test_the_dispatcher_counts_are_one_consistent_routing(ep, imbalance):
    plan = RoutingPlan(num_experts=128, topk=8, expert_parallel=ep, imbalance=imbalance)
    tokens = 16_384
    counts = plan.dispatcher_counts(tokens)
    assert counts["input_splits"].sum() == tokens * 8  # every copy of this rank's tokens is sent
    received = counts["output_splits"].sum()
    assert received == plan.received(tokens) == counts["tokens_per_expert"].sum() == counts["output_splits_tp"][0]
    assert counts["num_global_tokens_per_local_expert"].shape == (ep, 128 // ep)
    assert received == pytest.approx(tokens * 8 * plan.effective_imbalance(), rel=1e-3)
    # what permute's masked_select takes: k per token over all experts, one per received copy locally
    assert plan.masked_count((128, tokens)) == tokens * 8
    if ep > 1:
        assert plan.masked_count((128 // ep, received)) == received
    assert plan.masked_count((3, 5, 7)) is None


@pytest.mark.parametrize("overrides", [[], ["distributed.expert_parallel=1"], ["distributed.expert_parallel=4"]])
def test_the_plans_imbalance_is_the_planners(overrides):
    """The plan's default (2x) capped as the planner caps it: what a rank can receive."""
    config, arch = load_config(REPO / "configs/qwen3_30b_a3b_gspo.yaml", overrides), load_hf_config(HF_30B)
    plan = RoutingPlan(arch.num_experts, arch.num_experts_per_tok, config.distributed.expert_parallel,
                       imbalance=EXPERT_IMBALANCE)
    assert plan.effective_imbalance() == pytest.approx(expert_imbalance(config, arch))
    assert RoutingPlan(128, 8, 8, imbalance=50.0).effective_imbalance() == 8.0  # at most k copies a token


@pytest.mark.parametrize("overrides", [[], ["model.recompute=none"], ["model.fused_logprobs=false"]])
def test_flops_by_kind_add_up_to_the_planners_hardware_flops(overrides):
    """One microbatch's FLOPs by kind (what the rehearsal compares op by op) are the planner's
    hardware count of one update over the same sequences, split (TP 1, balanced experts)."""
    config = load_config(REPO / "configs/qwen3_30b_a3b_gspo.yaml", ["train.ppo_epochs=1", *overrides])
    arch = load_hf_config(HF_30B)
    lengths = [4096, 4096, 3000, 512]
    kinds = flops_by_kind(config, arch, lengths)
    assert sum(kinds.values()) == pytest.approx(update_flops(config, arch, lengths).hardware, rel=1e-12)
    doubled = flops_by_kind(config, arch, lengths, expert_share=2.0)
    assert doubled["experts"] == pytest.approx(2 * kinds["experts"]) and doubled["dense"] == kinds["dense"]


@pytest.mark.slow
def test_planted_gpu_slips_are_named_at_their_lines():
    """A CPU tensor into a device op, int64 or host grouped-GEMM offsets, a float32 activation into a
    bf16 GEMM: each in a copy of a project function, each named with the op and the copy's line;
    the honest copies run through; without the rehearsal's mode the dtype slip passes (the meta
    kernels check none), which is why the mode checks it."""
    done = subprocess.run([sys.executable, str(REPO / "tests/workers/rehearsal_slips.py")], capture_output=True,
                          text=True, env=environment(), timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["honest"] == [None, None, None]
    worker = "tests/workers/rehearsal_slips.py"
    assert found["offsets on the host"].startswith(f"_grouped_mm at {worker}:32: offsets on cpu")
    assert found["int64 offsets"].startswith(f"_grouped_mm at {worker}:32: offsets are torch.int64")
    assert found["float32 into bf16"].startswith(f"mm.default at {worker}:41: operands float32 x bfloat16")
    assert found["host tensor into a device op"].startswith(f"add.Tensor at {worker}:45:")
    assert found["float32 into bf16 without the mode"] is None
