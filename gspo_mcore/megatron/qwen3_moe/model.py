"""Build a Megatron-Core GPTModel that computes exactly what Hugging Face's Qwen3-MoE does."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from gspo_mcore.config import ConfigError, DistributedConfig, ModelConfig
from gspo_mcore.megatron.qwen3_moe.hf_config import HFConfigError, Qwen3MoeArch
from gspo_mcore.megatron.qwen3_moe.layer_spec import decoder_block_spec
from gspo_mcore.megatron.qwen3_moe.routing import drop_dispatch_state, drop_padding_routes, out_tokens_from_the_map
from gspo_mcore.megatron.te_compat import bind_missing_transformer_engine

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def check_layout(arch: Qwen3MoeArch, dist: DistributedConfig, world_size: int) -> None:
    """The one layout check (the trainer, the converter and the planner call it): the divisibility
    the sharding needs, of the model's shapes and of the `world_size` trainer ranks; each message
    names the field that does not fit."""
    tp, ep, etp, pp = (
        dist.tensor_parallel, dist.expert_parallel, dist.expert_tensor_parallel, dist.pipeline_parallel
    )
    checks = [
        (arch.num_attention_heads % tp == 0, f"num_attention_heads {arch.num_attention_heads}", "tensor_parallel", tp),
        (arch.num_key_value_heads % tp == 0, f"num_key_value_heads {arch.num_key_value_heads}", "tensor_parallel", tp),
        (arch.vocab_size % tp == 0, f"vocab_size {arch.vocab_size}", "tensor_parallel", tp),
        (arch.num_experts % ep == 0, f"num_experts {arch.num_experts}", "expert_parallel", ep),
        (arch.num_layers % pp == 0, f"num_hidden_layers {arch.num_layers}", "pipeline_parallel", pp),
        (arch.moe_intermediate_size % etp == 0, f"moe_intermediate_size {arch.moe_intermediate_size}",
         "expert_tensor_parallel", etp),
        (arch.intermediate_size % tp == 0, f"intermediate_size {arch.intermediate_size}", "tensor_parallel", tp),
    ]
    for ok, what, field, size in checks:
        if not ok:
            raise HFConfigError(f"{what} is not divisible by distributed.{field} = {size}")
    for size, what in ((tp * pp, "tensor_parallel x pipeline_parallel"),
                       (ep * etp * pp, "expert_parallel x expert_tensor_parallel x pipeline_parallel")):
        if world_size % size:
            raise ConfigError(f"distributed: {world_size} trainer ranks are not divisible by {what} = {size}")


def _parallelism(dist: DistributedConfig) -> dict:
    return dict(
        tensor_model_parallel_size=dist.tensor_parallel,
        pipeline_model_parallel_size=dist.pipeline_parallel,
        expert_model_parallel_size=dist.expert_parallel,
        expert_tensor_parallel_size=dist.expert_tensor_parallel,
        sequence_parallel=dist.tensor_parallel > 1,
        # RL microbatches differ in length and size: the pipeline sends shapes first.
        variable_seq_lengths=dist.pipeline_parallel > 1,
    )


def _fusions(on_gpu: bool) -> dict:
    """Fused kernels exist only with CUDA / Transformer Engine."""
    return dict(bias_activation_fusion=on_gpu, bias_dropout_fusion=on_gpu, masked_softmax_fusion=on_gpu,
                apply_rope_fusion=on_gpu, moe_permute_fusion=on_gpu, gradient_accumulation_fusion=False)


def transformer_config(arch: Qwen3MoeArch, model: ModelConfig, dist: DistributedConfig,
                       routing_replay: bool = False) -> TransformerConfig:
    dtype = DTYPES[model.dtype]
    on_gpu = model.spec == "te"
    return TransformerConfig(
        # shapes
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_key_value_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.intermediate_size,
        # numerics that must match HF
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=arch.attention_dropout,
        init_method_std=arch.initializer_range,
        # MoE
        num_moe_experts=arch.num_experts,
        moe_ffn_hidden_size=arch.moe_intermediate_size,
        moe_router_topk=arch.num_experts_per_tok,
        moe_router_score_function="softmax",
        # Megatron's pre_softmax=False takes top-k of the logits, then softmax over those k:
        # identical to HF's softmax -> top-k -> renormalise (norm_topk_prob=True).
        moe_router_pre_softmax=not arch.norm_topk_prob,
        moe_router_dtype="fp32",
        moe_enable_routing_replay=routing_replay,
        moe_layer_freq=[int(m) for m in arch.moe_layers],
        moe_router_load_balancing_type="aux_loss" if model.moe_aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=model.moe_aux_loss_coeff,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=on_gpu,
        **_parallelism(dist),
        # Memory: keep only each layer's input and recompute the layer in backward.
        **(dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
           if model.recompute == "full" else {}),
        # dtype / device
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=dist.device == "cpu",
        # No CUDA graphs; the empty list is the default "full" layer in its current spelling
        # (the default itself warns "full scope is deprecated" on every run).
        cuda_graph_scope=[],
        **_fusions(on_gpu),
    )


def build_model(arch: Qwen3MoeArch, model: ModelConfig, dist: DistributedConfig,
                routing_replay: bool = False) -> GPTModel:
    """The GPTModel of this pipeline stage; parallel state must already be initialised.
    `routing_replay`: its routers can take given top-k experts (megatron-core's RouterReplay)."""
    # Every model we build comes through here (learner, reference, parity, the converter's verify): without
    # Transformer Engine, megatron-core 0.16.1's router would read an unbound name on its first forward.
    bind_missing_transformer_engine()
    config = transformer_config(arch, model, dist, routing_replay)
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=decoder_block_spec(config, arch.moe_layers, model.spec),
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=arch.rope_theta,
        parallel_output=True,
    )
    if model.spec == "te":
        # TEGroupedLinear hides expert-TP from Transformer Engine (parallel_mode None), which
        # then marks every weight partition_dim 0; fc2 is row-parallel: split on its input.
        for name, param in gpt.named_parameters():
            if ".mlp.experts.linear_fc2.weight" in name:
                param.partition_dim = 1
    if dist.expert_parallel == 1 and dist.expert_tensor_parallel != dist.tensor_parallel:
        # Megatron marks expert weights `allreduce=False` (-> reduced over the expert-data-
        # parallel group) only when EP > 1. With EP = 1 and ETP < TP, each TP rank runs its
        # own tokens through a replica of every expert: the dense DP group would miss the
        # other TP ranks' share of the gradient.
        for name, param in gpt.named_parameters():
            if ".mlp.experts." in name:
                param.allreduce = False
    for module in gpt.modules():
        if getattr(module, "token_dispatcher", None) is not None:
            module.register_forward_hook(drop_dispatch_state)
            module.router.register_forward_hook(drop_padding_routes)  # before any RouterHooks: they count it
            if config.moe_permute_fusion:
                out_tokens_from_the_map(module.token_dispatcher)
    return gpt
