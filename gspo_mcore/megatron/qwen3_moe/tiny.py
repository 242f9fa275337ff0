"""A tiny random Qwen3-MoE checkpoint in Hugging Face format, made locally (no model hub).

It keeps every structural trait of the real models that the conversion must get right:
head_dim != hidden/heads, GQA, QK-norm, norm_topk_prob, a dense layer via mlp_only_layers,
untied embeddings. Weights are random, norms included (all-ones norms would hide a
swapped-norm mapping bug), with a scale that gives logits of order one.
"""

from __future__ import annotations

from pathlib import Path

import torch

TINY_QWEN3_MOE = dict(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # != 64 / 4
    intermediate_size=96,
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    mlp_only_layers=[1],
    decoder_sparse_step=1,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    initializer_range=0.02,
)


def make_tiny_checkpoint(
    out_dir: str | Path, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides
) -> Path:
    """Write config.json + model.safetensors of a random tiny Qwen3-MoE to `out_dir`."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # heavy: test and demo models only

    config = Qwen3MoeConfig(**{**TINY_QWEN3_MOE, **overrides})
    generator = torch.Generator().manual_seed(seed)
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)
            else:  # ~unit-variance outputs: std 1/sqrt(fan_in)
                param.copy_(noise / param.shape[-1] ** 0.5)
    out_dir = Path(out_dir)
    model.to(dtype).save_pretrained(out_dir)
    return out_dir
