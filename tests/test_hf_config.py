import json

import pytest

from gspo_mcore.megatron.qwen3_moe.hf_config import HFConfigError, load_hf_config, parse_hf_config

# The published Qwen3-30B-A3B config.json (transformers 4.x field names).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
    "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
    "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}


def test_qwen3_30b_a3b_fields():
    arch = parse_hf_config(QWEN3_30B_A3B)
    assert (arch.hidden_size, arch.num_layers, arch.num_attention_heads, arch.num_key_value_heads) == (2048, 48, 32, 4)
    assert arch.head_dim == 128 != arch.hidden_size // arch.num_attention_heads
    assert (arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size) == (128, 8, 768)
    assert arch.norm_topk_prob and not arch.tie_word_embeddings
    assert arch.moe_layers == (True,) * 48 and arch.num_dense_layers == 0
    assert arch.rope_theta == 1e6 and arch.rms_norm_eps == 1e-6 and arch.vocab_size == 151936


def test_transformers5_names_and_dense_layers(tiny_hf_dir):
    raw = json.loads((tiny_hf_dir / "config.json").read_text())
    assert "num_local_experts" in raw or "num_experts" in raw  # whichever transformers wrote
    arch = load_hf_config(tiny_hf_dir)
    assert arch.moe_layers == (True, False, True, True)  # mlp_only_layers=[1]
    assert arch.head_dim == 32 and arch.hidden_size // arch.num_attention_heads == 16
    assert arch.rope_theta == 1e6


def test_decoder_sparse_step():
    arch = parse_hf_config({**QWEN3_30B_A3B, "num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert arch.moe_layers == (False, True, False, False)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"hidden_act": "gelu"}, "'hidden_act' = 'gelu' is not supported"),
        ({"attention_bias": True}, "'attention_bias' = True is not supported"),
        ({"use_sliding_window": True}, "'use_sliding_window'"),
        ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "'rope_scaling'"),
        ({"some_new_field": 1}, "unknown field 'some_new_field'"),
        ({"model_type": "qwen3"}, "is not Qwen3-MoE"),
        ({"num_key_value_heads": 5}, "not a multiple of num_key_value_heads 5"),
        ({"num_experts_per_tok": 129}, "num_experts_per_tok 129"),
        ({"mlp_only_layers": [48]}, "mlp_only_layers has 48"),
    ],
)
def test_unsupported_values_are_clear_errors(change, message):
    with pytest.raises(HFConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_hf_config({**QWEN3_30B_A3B, **change})


def test_missing_field_is_named():
    cfg = dict(QWEN3_30B_A3B)
    del cfg["moe_intermediate_size"]
    with pytest.raises(HFConfigError, match="missing field 'moe_intermediate_size'"):
        parse_hf_config(cfg)


def test_rope_parameters_non_default_refused():
    cfg = {k: v for k, v in QWEN3_30B_A3B.items() if k not in ("rope_theta", "rope_scaling")}
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}
    with pytest.raises(HFConfigError, match="rope_parameters"):
        parse_hf_config(cfg)


def test_file_errors_name_the_file(tmp_path):
    with pytest.raises(HFConfigError, match="config.json not found"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(HFConfigError, match=f"{tmp_path}/config.json: not valid JSON"):
        load_hf_config(tmp_path)
