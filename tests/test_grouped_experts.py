"""The `torch` spec's experts (gspo_mcore.megatron.qwen3_moe.experts): the grouped matmul against a per-token
reference, forward and gradients; the kernel chosen by device and dtype, a slow one refused on CUDA; the module
computing what megatron-core 0.16.1's SequentialMLP computes, with its checkpoint entries key for key; and,
under parallel layouts (slow), a training step equal to transformers'."""

import types

import pytest
import torch
import torch.nn.functional as F
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.transformer_config import TransformerConfig

from conftest import plan_layout_job
from gspo_mcore.common.errors import InputError
from gspo_mcore.megatron.qwen3_moe import experts
from gspo_mcore.megatron.qwen3_moe.experts import (
    GROUPED_MM,
    LOOP,
    TorchGroupedMLP,
    expert_offsets,
    grouped_kernel,
    grouped_matmul,
)

COUNTS = [3, 0, 5, 1, 0, 7]  # experts without tokens among them, one at the end


def _operands(counts, k=16, n=24, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), k, generator=g, device="cpu").to(dtype).requires_grad_()
    w = torch.randn(len(counts), n, k, generator=g, device="cpu").to(dtype).requires_grad_()
    return x, w, torch.tensor(counts, device="cpu")


def _reference(x, w, counts):
    """Token by token: each row times the weight of the expert it belongs to (no split, no loop over experts)."""
    expert_of_row = torch.repeat_interleave(torch.arange(len(counts), device="cpu"), counts)
    return torch.einsum("tk,tnk->tn", x, w[expert_of_row])


def _forward_and_grads(fn, x, w, counts):
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    out = fn(x, w, counts)
    out.backward(torch.cos(torch.arange(out.numel(), device="cpu", dtype=out.dtype)).view_as(out))
    return out.detach(), x.grad, w.grad


@pytest.mark.parametrize("counts", [COUNTS, [0, 0, 0]], ids=["some-empty", "no-tokens"])
def test_grouped_matmul_is_the_per_expert_product(counts):
    x, w, counts = _operands(counts)
    ours = _forward_and_grads(lambda x, w, c: grouped_matmul(x, w, expert_offsets(c, x.device)), x, w, counts)
    reference = _forward_and_grads(_reference, x, w, counts)
    for a, b in zip(ours, reference):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    empty = [e for e, n in enumerate(counts.tolist()) if n == 0]
    assert torch.count_nonzero(ours[2][empty]) == 0  # an expert without tokens: a zero gradient, not none


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no torch._grouped_mm")
def test_the_cuda_call_computes_the_same_on_the_host(monkeypatch):
    """The exact call the CUDA path makes (torch._grouped_mm, offsets, the weight transposed as a view) run
    through torch's host implementation: the same products and gradients as the loop."""
    x, w, counts = _operands(COUNTS)
    loop = _forward_and_grads(lambda x, w, c: grouped_matmul(x, w, expert_offsets(c, x.device)), x, w, counts)
    monkeypatch.setattr(experts, "grouped_kernel", lambda *args, **kwargs: GROUPED_MM)
    monkeypatch.setattr(experts, "device_capability", lambda device: (9, 0))  # an H100's
    called = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: called.append(1) or real(*a, **k))
    grouped = _forward_and_grads(lambda x, w, c: grouped_matmul(x, w, expert_offsets(c, x.device)), x, w, counts)
    assert called
    for a, b in zip(grouped, loop):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no torch._grouped_mm")
def test_on_sm100_an_expert_without_tokens_gets_a_zero_weight_gradient(monkeypatch):
    """pytorch#172439: sm100's _grouped_mm leaves garbage in the weight gradient of a zero-size group. A
    stand-in kernel that does so (the host kernel plus a gradient into every expert's weight): on sm100 the
    empty experts' gradients are zero and the others are the kernel's; on sm90 nothing is masked."""
    assert experts.zeroes_empty_expert_grads((10, 0)) and not experts.zeroes_empty_expert_grads((9, 0))
    x, w, counts = _operands(COUNTS)
    real = torch._grouped_mm

    def garbage_in_empty_groups(a, b, offs):
        return real(a, b, offs=offs) + 1e-3 * b.sum()  # every expert's weight gets a gradient

    monkeypatch.setattr(experts, "grouped_kernel", lambda *args, **kwargs: GROUPED_MM)
    monkeypatch.setattr(torch, "_grouped_mm", garbage_in_empty_groups)
    run = lambda x, w, c: grouped_matmul(x, w, expert_offsets(c, x.device))  # noqa: E731
    empty = [e for e, n in enumerate(COUNTS) if n == 0]
    monkeypatch.setattr(experts, "device_capability", lambda device: (9, 0))
    hopper = _forward_and_grads(run, x, w, counts)
    assert torch.count_nonzero(hopper[2][empty]) > 0  # the stand-in's garbage, unmasked
    monkeypatch.setattr(experts, "device_capability", lambda device: (10, 0))
    blackwell = _forward_and_grads(run, x, w, counts)
    assert torch.count_nonzero(blackwell[2][empty]) == 0
    full = [e for e, n in enumerate(COUNTS) if n]
    torch.testing.assert_close(blackwell[2][full], hopper[2][full], rtol=0, atol=0)
    torch.testing.assert_close(blackwell[1], hopper[1], rtol=0, atol=0)  # the input's gradient untouched


CUDA = torch.device("cuda", 0)  # a device object: no GPU needed to name one


@pytest.mark.parametrize("device, dtype, capability, kernel", [
    (torch.device("cpu"), torch.float32, None, LOOP),
    (torch.device("cpu"), torch.bfloat16, None, LOOP),
    (CUDA, torch.float32, (9, 0), LOOP),  # no float32 grouped kernel: the loop, chosen by name
    (CUDA, torch.bfloat16, (9, 0), GROUPED_MM),  # H100 / H200
    (CUDA, torch.bfloat16, (10, 0), GROUPED_MM),  # B200
])
def test_kernel_by_device_and_dtype(device, dtype, capability, kernel):
    assert grouped_kernel(device, dtype, 2048, 1536, capability) == kernel


@pytest.mark.parametrize("dtype, capability, k, message", [
    (torch.bfloat16, (8, 0), 2048, "needs an sm90 or sm100 GPU, not sm80"),  # torch would loop: refused
    (torch.bfloat16, (8, 9), 2048, "not sm89"),
    (torch.float16, (9, 0), 2048, "takes bfloat16, not torch.float16"),
    (torch.bfloat16, (9, 0), 2044, "input size 2044 is not a multiple of 8"),
])
def test_a_slow_or_unaligned_grouped_gemm_is_refused_on_cuda(dtype, capability, k, message):
    with pytest.raises(InputError, match=message):
        grouped_kernel(CUDA, dtype, k, 1536, capability)


# ---- the module against megatron-core's SequentialMLP -----------------------------------------


def _group(size, rank):
    return types.SimpleNamespace(size=lambda: size, rank=lambda: rank)


# Rank 1 of 2 expert-parallel ranks (global experts 4-7) and of 2 expert-data-parallel ranks; torch.distributed
# is not started, so the checkpoint helpers read TP and DP rank 0 (the experts' replica ids say expert-DP rank 1).
PG = types.SimpleNamespace(ep=_group(2, 1), expt_tp=_group(1, 0), expt_dp=_group(2, 1))
META = {"dp_cp_group": _group(1, 0)}


def _config(**extra):
    return TransformerConfig(**{**dict(num_layers=1, hidden_size=16, num_attention_heads=2, ffn_hidden_size=24,
                                       moe_ffn_hidden_size=8, num_moe_experts=8, gated_linear_unit=True,
                                       activation_func=F.silu, add_bias_linear=False, use_cpu_initialization=True,
                                       expert_model_parallel_size=2), **extra})


def _pair(num_local_experts, **extra):
    config = _config(**extra)
    sequential = SequentialMLP(num_local_experts, config,
                               MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
                               pg_collection=PG)
    grouped = TorchGroupedMLP(num_local_experts, config, pg_collection=PG)
    grouped.load_state_dict(sequential.state_dict())  # SequentialMLP's per-expert keys, stacked by the pre-hook
    return sequential, grouped


@pytest.mark.parametrize("num_local_experts, counts", [(4, [3, 0, 5, 2]), (1, [6])])
@pytest.mark.parametrize("extra", [{}, {"moe_apply_probs_on_input": True, "moe_router_topk": 1,
                                               "moe_router_pre_softmax": True}],
                         ids=["probs-on-activation", "probs-on-input"])
def test_experts_compute_what_sequential_mlp_computes(num_local_experts, counts, extra):
    sequential, grouped = _pair(num_local_experts, **extra)
    for e, expert in enumerate(sequential.local_experts):
        assert torch.equal(grouped.weight1[e], expert.linear_fc1.weight)
        assert torch.equal(grouped.weight2[e], expert.linear_fc2.weight)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(sum(counts), 16, generator=g, device="cpu")
    probs = torch.rand(sum(counts), generator=g, device="cpu")
    results = []
    for module in (sequential, grouped):
        x, p = hidden.clone().requires_grad_(), probs.clone().requires_grad_()
        out, bias = module(x, torch.tensor(counts, device="cpu"), p)
        assert bias is None
        out.backward(torch.sin(torch.arange(out.numel(), device="cpu", dtype=out.dtype)).view_as(out))
        results.append((out.detach(), x.grad, p.grad))
    (out_a, *grads_a), (out_b, *grads_b) = results
    assert torch.equal(out_a, out_b)  # the same matmuls, in the same order, on CPU
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    for e, expert in enumerate(sequential.local_experts):
        torch.testing.assert_close(grouped.weight1.grad[e], expert.linear_fc1.weight.grad, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(grouped.weight2.grad[e], expert.linear_fc2.weight.grad, atol=1e-6, rtol=1e-6)


def _described(entry):
    """What a checkpoint holds of one sharded entry, factories built."""
    if isinstance(entry, ShardedTensorFactory):
        return [_described(e) for e in entry.build()]
    if isinstance(entry, ShardedObject):
        return ("object", entry.key, entry.global_shape, entry.global_offset, entry.replica_id, entry.data)
    assert isinstance(entry, ShardedTensor)
    return ("tensor", entry.key, entry.global_shape, entry.global_offset, entry.axis_fragmentations,
            entry.replica_id, entry.prepend_axis_num, entry.data.tolist())


@pytest.mark.parametrize("singleton", [False, True], ids=["stacked", "singleton-local-shards"])
def test_checkpoint_entries_are_sequential_mlps(singleton):
    """Key for key, shard for shard: checkpoints of either module are one checkpoint."""
    sequential, grouped = _pair(4)
    prefix = "decoder.layers.0.mlp.experts."
    metadata = {**META, "singleton_local_shards": singleton}
    theirs = sequential.sharded_state_dict(prefix, metadata=dict(metadata))
    ours = grouped.sharded_state_dict(prefix, metadata=dict(metadata))
    assert list(ours) == list(theirs)
    assert any("experts.experts.linear_fc1.weight" in str(_described(v)) for v in ours.values()) != singleton
    for key in theirs:
        assert _described(ours[key]) == _described(theirs[key]), key


def test_a_partial_checkpoint_is_reported_not_stacked():
    sequential, grouped = _pair(4)
    state = sequential.state_dict()
    del state["local_experts.2.linear_fc2.weight"]
    with pytest.raises(RuntimeError, match=r"(?s)Missing key\(s\).*weight2.*Unexpected key\(s\).*local_experts"):
        grouped.load_state_dict(state)


def test_what_the_experts_do_not_support_is_refused():
    with pytest.raises(InputError, match="do not support expert biases"):
        TorchGroupedMLP(2, _config(add_bias_linear=True), pg_collection=PG)


def test_parallel_weights_views_follow_the_local_specs_names_and_order():
    _, grouped = _pair(2)
    names = [name for name, *_ in grouped.expert_weights()]
    assert names == ["local_experts.0.linear_fc1.weight", "local_experts.0.linear_fc2.weight",
                     "local_experts.1.linear_fc1.weight", "local_experts.1.linear_fc2.weight"]
    for _, view, stacked, partition_dim in grouped.expert_weights():
        assert view.data_ptr() >= stacked.data_ptr() and view._base is stacked  # a view: a copy into it lands
        assert partition_dim == (0 if stacked is grouped.weight1 else 1)  # Column- / RowParallelLinear's
