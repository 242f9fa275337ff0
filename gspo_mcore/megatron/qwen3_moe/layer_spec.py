"""Megatron module specs for Qwen3-MoE decoder layers: `te` (Transformer Engine, GPU), `local` (megatron-core's
local modules, torch SDPA attention) and `torch` (`local` with the experts as grouped GEMMs: experts.py). All
three read and write the same checkpoint keys."""

from __future__ import annotations

from functools import partial

import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)

from gspo_mcore.common.errors import InputError
from gspo_mcore.megatron.qwen3_moe.attention import ScaledDotProductAttention
from gspo_mcore.megatron.qwen3_moe.experts import TorchGroupedMLP


class RMSNorm(torch.nn.Module):
    """RMSNorm with Hugging Face Qwen3's numerics (normalise in float32, cast back, then
    scale), usable with sequence parallelism, which Megatron's WrappedTorchNorm refuses.

    Under sequence parallelism each TP rank normalises a different slice of the sequence,
    so the weight's gradient is partial: `sequence_parallel = True` makes Megatron's
    finalize_model_grads all-reduce it over the TP group (as it does for TENorm)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        where = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype, device=where))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        dtype = hidden.dtype
        hidden = hidden.float()
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * hidden.to(dtype)


def _local_layer_spec(num_experts: int | None, grouped_experts: bool = False) -> ModuleSpec:
    """The `local` spec's layer; `grouped_experts`: the `torch` spec's, whose MoE experts are TorchGroupedMLP
    (SequentialMLP's constructor, forward and checkpoint) under the same router and token dispatcher."""
    if num_experts:
        mlp = get_moe_module_spec_for_backend(LocalSpecProvider(), num_experts=num_experts, moe_grouped_gemm=False)
        if grouped_experts:
            mlp.submodules.experts = ModuleSpec(module=TorchGroupedMLP)
    else:
        mlp = ModuleSpec(
            module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
        )
    attention = ModuleSpec(
        module=SelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=ColumnParallelLinear,
            # torch's fused SDPA, not Megatron's DotProductAttention (O(s^2) memory: attention.py).
            core_attention=ScaledDotProductAttention,
            linear_proj=RowParallelLinear,
            q_layernorm=RMSNorm,
            k_layernorm=RMSNorm,
        ),
    )
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=RMSNorm,
            self_attention=attention,
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=RMSNorm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
            # Checkpoint keys of the Transformer Engine spec, whose layers fuse these norms
            # into the next linear (the dense MLP's only: MoE layers keep pre_mlp_layernorm),
            # so one checkpoint loads into either module set.
            sharded_state_dict_keys_map={
                "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                **({} if num_experts else {"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}),
            },
        ),
    )


def _te_layer_spec(num_experts: int | None) -> ModuleSpec:
    # Imported here: the module needs Transformer Engine, which only the GPU image has.
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    return get_gpt_layer_with_transformer_engine_spec(
        num_experts=num_experts, moe_grouped_gemm=bool(num_experts), qk_layernorm=True
    )


def decoder_block_spec(
    config: TransformerConfig, moe_layers: tuple[bool, ...], spec: str
) -> TransformerBlockSubmodules:
    """Specs of the layers this pipeline stage builds (dense or MoE per layer)."""
    if spec == "te":
        try:
            import transformer_engine  # noqa: F401
        except ImportError:
            raise InputError(
                "model.spec: 'te' needs Transformer Engine (pip install 'gspo-mcore[gpu]', or use the GPU image)"
            ) from None
        from megatron.core.extensions.transformer_engine import TENorm

        layer_spec, norm = _te_layer_spec, TENorm
    elif spec == "torch":
        layer_spec, norm = partial(_local_layer_spec, grouped_experts=True), RMSNorm
    else:
        layer_spec, norm = _local_layer_spec, RMSNorm
    dense, moe = layer_spec(None), layer_spec(config.num_moe_experts)
    specs = [moe if is_moe else dense for is_moe in moe_layers]
    offset = get_transformer_layer_offset(config)
    return TransformerBlockSubmodules(
        layer_specs=specs[offset : offset + get_num_layers_to_build(config)], layer_norm=norm
    )
