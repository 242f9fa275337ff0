"""Synthetic Hugging Face Qwen3-MoE checkpoints with the real models' per-layer structure
(random weights, written with safetensors directly: no transformers, no model hub).
Used by the tests and the benchmark; also handy to rehearse a pipeline before the real weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from gspo_mcore.megatron.qwen3_moe.hf_config import parse_hf_config
from gspo_mcore.megatron.qwen3_moe.state_dict_adapter import hf_shape, layer_rules, non_layer_rules

_BASE = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
    "attention_dropout": 0.0, "hidden_act": "silu", "decoder_sparse_step": 1, "mlp_only_layers": [],
    "norm_topk_prob": True, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_scaling": None,
    "tie_word_embeddings": False, "use_sliding_window": False, "max_position_embeddings": 40960,
    "initializer_range": 0.02, "torch_dtype": "bfloat16",
}
# Per-layer structure of the published models (attention heads, KV heads, head_dim, experts,
# top-k); hidden and FFN sizes are arguments so that tests stay small.
QWEN3_30B_A3B = {**_BASE, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                 "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936, "hidden_size": 2048,
                 "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48}
QWEN3_235B_A22B = {**_BASE, "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
                   "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936, "hidden_size": 4096,
                   "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_hidden_layers": 94}


def write_synthetic_checkpoint(out_dir, config: dict, dtype=torch.bfloat16, seed: int = 0) -> Path:
    """config.json + one safetensors shard per layer (+ one for embeddings/norm/head) + index."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    arch = parse_hf_config(config)
    generator = torch.Generator().manual_seed(seed)
    groups = [non_layer_rules(arch, "local")] + [layer_rules(arch, "local", i) for i in range(arch.num_layers)]
    weight_map, total = {}, 0
    for index, rules in enumerate(groups):
        shard_name = f"model-{index + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for name in (name for rule in rules for name in rule.hf):
            tensors[name] = (torch.randn(hf_shape(arch, name), generator=generator) * 0.02).to(dtype)
            weight_map[name] = shard_name
            total += tensors[name].numel() * tensors[name].element_size()
        save_file(tensors, str(out_dir / shard_name), metadata={"format": "pt"})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir
