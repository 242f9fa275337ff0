"""Read a Hugging Face Qwen3-MoE `config.json` into the fields that change numerics.

Pure Python: no torch, no Megatron. Every key of the file is either mapped, checked
against the only value we implement, or known to have no effect on the forward pass;
anything else is an error, because a silently ignored field is a silently wrong model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from gspo_mcore.common.errors import InputError


class HFConfigError(InputError):
    """A config.json we cannot build an exact Megatron model from."""


@dataclass(frozen=True)
class Qwen3MoeArch:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int  # differs from hidden_size / num_attention_heads in the real models
    intermediate_size: int  # dense (mlp_only) layers
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool  # softmax over all experts, top-k, then renormalise the k weights
    moe_layers: tuple[bool, ...]  # per layer: MoE (True) or dense SwiGLU MLP (False)
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    attention_dropout: float
    initializer_range: float

    @property
    def num_dense_layers(self) -> int:
        return sum(not m for m in self.moe_layers)


# Keys with no effect on the forward pass or on training numerics.
_NO_NUMERICS = {
    "bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype", "dtype", "transformers_version",
    "use_cache", "output_router_logits", "router_aux_loss_coef",  # aux loss is a trainer setting here
    "max_window_layers",  # only read when use_sliding_window is true, which we refuse
    "sliding_window",  # likewise
    "_name_or_path", "tokenizer_class", "generation_config",
}
# Keys we implement for exactly one value.
_FIXED = {
    "hidden_act": "silu",
    "attention_bias": False,
    "use_sliding_window": False,
    "rope_scaling": None,
    "quantization_config": None,
}
_ARCHITECTURE = "Qwen3MoeForCausalLM"


def _take(cfg: dict, key: str, *aliases: str):
    for name in (key, *aliases):
        if name in cfg:
            return cfg[name]
    raise HFConfigError(f"config.json: missing field '{key}'")


def _rope_theta(cfg: dict) -> float:
    # transformers < 5 writes `rope_theta` (+ `rope_scaling`); >= 5 writes `rope_parameters`.
    if "rope_parameters" in cfg:
        params = dict(cfg["rope_parameters"] or {})
        rope_type = params.pop("rope_type", "default")
        theta = params.pop("rope_theta", cfg.get("rope_theta"))
        if rope_type != "default" or params:
            raise HFConfigError(
                f"config.json: rope_parameters {cfg['rope_parameters']} is not supported "
                "(only plain RoPE: rope_type 'default' with rope_theta)"
            )
        if theta is None:
            raise HFConfigError("config.json: missing field 'rope_theta'")
        return float(theta)
    return float(_take(cfg, "rope_theta"))


def _check_fields(cfg: dict) -> None:
    """The model type, the fields whose only supported value is fixed, and no unknown field."""
    architectures = cfg.get("architectures") or [_ARCHITECTURE]
    if cfg.get("model_type") != "qwen3_moe" or architectures != [_ARCHITECTURE]:
        raise HFConfigError(
            f"config.json: model_type {cfg.get('model_type')!r} / architectures {architectures} "
            f"is not Qwen3-MoE (expected model_type 'qwen3_moe', architectures ['{_ARCHITECTURE}'])"
        )
    for key, expected in _FIXED.items():
        if key in cfg and cfg[key] != expected:
            raise HFConfigError(
                f"config.json: field '{key}' = {cfg[key]!r} is not supported (only {expected!r})"
            )

    mapped = {
        "architectures", "model_type", "vocab_size", "hidden_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
        "moe_intermediate_size", "num_experts", "num_local_experts", "num_experts_per_tok",
        "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "rope_theta", "rope_parameters",
        "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings", "attention_dropout",
        "initializer_range",
    }
    unknown = sorted(set(cfg) - mapped - _NO_NUMERICS - set(_FIXED))
    if unknown:
        raise HFConfigError(
            f"config.json: unknown field '{unknown[0]}' (its effect on the model is not known; refusing to guess)"
        )


def _moe_layers(cfg: dict, num_layers: int, num_experts: int) -> tuple[bool, ...]:
    """Which layers are MoE (the rest dense), by transformers' Qwen3MoeDecoderLayer's rule."""
    sparse_step = int(cfg.get("decoder_sparse_step", 1))
    mlp_only = [int(i) for i in (cfg.get("mlp_only_layers") or [])]
    bad = [i for i in mlp_only if not 0 <= i < num_layers]
    if bad:
        raise HFConfigError(f"config.json: mlp_only_layers has {bad[0]}, outside 0..{num_layers - 1}")
    if num_experts <= 0 or sparse_step <= 0:
        raise HFConfigError(
            f"config.json: num_experts {num_experts} / decoder_sparse_step {sparse_step} must be positive"
        )
    return tuple(i not in mlp_only and (i + 1) % sparse_step == 0 for i in range(num_layers))


def parse_hf_config(cfg: dict) -> Qwen3MoeArch:
    """Validate a config.json dict and return the architecture it describes."""
    _check_fields(cfg)
    num_layers = int(_take(cfg, "num_hidden_layers"))
    num_experts = int(_take(cfg, "num_experts", "num_local_experts"))
    moe_layers = _moe_layers(cfg, num_layers, num_experts)
    heads = int(_take(cfg, "num_attention_heads"))
    kv_heads = int(_take(cfg, "num_key_value_heads"))
    hidden = int(_take(cfg, "hidden_size"))
    top_k = int(_take(cfg, "num_experts_per_tok"))
    if heads % kv_heads:
        raise HFConfigError(
            f"config.json: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
        )
    if not 0 < top_k <= num_experts:
        raise HFConfigError(f"config.json: num_experts_per_tok {top_k} not in 1..num_experts ({num_experts})")

    return Qwen3MoeArch(
        vocab_size=int(_take(cfg, "vocab_size")),
        hidden_size=hidden,
        num_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        intermediate_size=int(_take(cfg, "intermediate_size")),
        moe_intermediate_size=int(_take(cfg, "moe_intermediate_size")),
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=bool(_take(cfg, "norm_topk_prob")),
        moe_layers=moe_layers,
        rope_theta=_rope_theta(cfg),
        rms_norm_eps=float(_take(cfg, "rms_norm_eps")),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=int(_take(cfg, "max_position_embeddings")),
        attention_dropout=float(cfg.get("attention_dropout", 0.0)),
        initializer_range=float(cfg.get("initializer_range", 0.02)),
    )


def load_hf_config(path: str | Path) -> Qwen3MoeArch:
    """`path` is a checkpoint directory or its config.json."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise HFConfigError(f"{file}: config.json not found")
    try:
        cfg = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise HFConfigError(f"{file}: not valid JSON ({err})") from None
    try:
        return parse_hf_config(cfg)
    except HFConfigError as err:
        raise HFConfigError(f"{file}: {str(err).removeprefix('config.json: ')}") from None
