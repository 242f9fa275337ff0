import pytest
import torch

from gspo_mcore.common.safetensors_io import HFCheckpointReader
from gspo_mcore.megatron.qwen3_moe.hf_config import load_hf_config
from gspo_mcore.megatron.qwen3_moe.state_dict_adapter import (
    GLU,
    QKV,
    all_rules,
    hf_to_mcore,
    mcore_to_hf,
    shard,
    unshard,
)
from gspo_mcore.megatron.qwen3_moe.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def checkpoint(request, tmp_path_factory):
    hf_dir = make_tiny_checkpoint(tmp_path_factory.mktemp("adapter"), seed=1, dtype=request.param)
    reader = HFCheckpointReader(hf_dir)
    return load_hf_config(hf_dir), {name: reader[name] for name in reader.keys()}


def test_adapter_needs_no_megatron():
    import subprocess
    import sys

    code = ("import sys, gspo_mcore.megatron.qwen3_moe.state_dict_adapter; "
            "sys.exit(any(m.split('.')[0] == 'megatron' for m in sys.modules))")  # megatron-core's package
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.parametrize("spec", ["local", "te", "torch"])
def test_round_trip_is_bitwise(checkpoint, spec):
    arch, hf = checkpoint
    rules = all_rules(arch, spec)
    mcore = dict(hf_to_mcore(arch, rules, hf.__getitem__))
    back = dict(mcore_to_hf(arch, rules, mcore.__getitem__))
    assert back.keys() == hf.keys()  # every HF tensor used, none invented
    for name, tensor in hf.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name


def test_names_per_spec(checkpoint):
    arch, _ = checkpoint
    local = {r.mcore for r in all_rules(arch, "local")}
    te = {r.mcore for r in all_rules(arch, "te")}
    assert "decoder.layers.0.input_layernorm.weight" in local
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in te
    assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in te  # dense layer: fused norm
    assert "decoder.layers.1.pre_mlp_layernorm.weight" in local
    assert "decoder.layers.0.pre_mlp_layernorm.weight" in te  # MoE layer: separate norm
    assert "decoder.layers.2.mlp.experts.local_experts.7.linear_fc2.weight" in local
    assert "decoder.layers.2.mlp.experts.linear_fc2.weight7" in te
    assert "output_layer.weight" in local  # untied
    # The torch spec's stacked experts are moved expert by expert under the local spec's names.
    assert [r.mcore for r in all_rules(arch, "torch")] == [r.mcore for r in all_rules(arch, "local")]


def test_qkv_is_interleaved_per_query_group(checkpoint):
    """Megatron's view: linear_qkv rows = for each KV group g: its q heads, then k_g, then v_g."""
    arch, hf = checkpoint
    rule = next(r for r in all_rules(arch, "local") if r.kind == QKV)
    fused = dict(hf_to_mcore(arch, [rule], hf.__getitem__))[rule.mcore]
    q, k, v = (hf[name] for name in rule.hf)
    d, heads_per_group = arch.head_dim, arch.num_attention_heads // arch.num_key_value_heads
    rows = []
    for g in range(arch.num_key_value_heads):
        for h in range(heads_per_group):
            head = g * heads_per_group + h
            rows.append(q[head * d:(head + 1) * d])
        rows += [k[g * d:(g + 1) * d], v[g * d:(g + 1) * d]]
    assert torch.equal(fused, torch.cat(rows))


def test_glu_fc1_is_gate_then_up(checkpoint):
    arch, hf = checkpoint
    rule = next(r for r in all_rules(arch, "local") if r.kind == GLU and "experts" in r.mcore)
    fused = dict(hf_to_mcore(arch, [rule], hf.__getitem__))[rule.mcore]
    gate, up = (hf[name] for name in rule.hf)
    assert torch.equal(fused[: gate.shape[0]], gate) and torch.equal(fused[gate.shape[0]:], up)


@pytest.mark.parametrize("kind", ["copy", GLU, QKV])
@pytest.mark.parametrize("dim", [0, 1])
def test_shard_unshard_round_trip(kind, dim):
    full, world = torch.randn(8, 12), 2
    shards = [shard(full, kind, dim, world, rank) for rank in range(world)]
    assert torch.equal(unshard(shards, kind, dim), full)


def test_glu_shards_hold_both_halves():
    gate, up = torch.arange(4.0).reshape(4, 1), torch.arange(4.0, 8.0).reshape(4, 1)
    rank1 = shard(torch.cat([gate, up]), GLU, 0, 2, 1)
    assert torch.equal(rank1, torch.cat([gate[2:], up[2:]]))


def test_tied_embeddings_have_no_lm_head(tmp_path):
    hf_dir = make_tiny_checkpoint(tmp_path, tie_word_embeddings=True)
    arch = load_hf_config(hf_dir)
    reader = HFCheckpointReader(hf_dir)
    rules = all_rules(arch, "local")
    assert not any(r.mcore == "output_layer.weight" for r in rules)
    mcore = dict(hf_to_mcore(arch, rules, reader.__getitem__))
    back = dict(mcore_to_hf(arch, rules, mcore.__getitem__))
    assert "lm_head.weight" not in back
    assert all(torch.equal(back[n], reader[n]) for n in back)
