"""Core attention without Transformer Engine: torch's fused scaled_dot_product_attention behind
megatron-core 0.16.1's `DotProductAttention` interface (transformer/dot_product_attention.py).

Megatron's own `DotProductAttention` materialises the scores: a [b*heads, s, s] buffer from the global memory
buffer, the scores, a float32 softmax copy and the saved probabilities: ~24-28 GB at 4 x 4096 tokens x 32
heads, on the first H100 run (issue 45 G3: 47.9 GB against a planned 24.1). SDPA's fused kernels keep O(s)
memory: each saves its inputs, its output and a float32 log-sum-exp [b, heads, s] for backward.

Same constructor and forward as `DotProductAttention`, called the same way by `SelfAttention.forward`
(transformer/attention.py, `apply_module(self.core_attention)(query, key, value, attention_mask,
attn_mask_type=..., attention_bias=..., packed_seq_params=...)`): query [sq, b, np, hn], key and value
[sk, b, ng, hn] (this TP rank's heads and query groups), the output [sq, b, np * hn].

Semantics kept from `DotProductAttention` (its torch softmax path, the one the `local` spec takes:
masked_softmax_fusion is off):
- the scale: `softmax_scale` (config.softmax_scale, as SelfAttention passes it) else 1/sqrt(head dim); with
  apply_query_key_layer_scaling Megatron divides by the layer number and multiplies back inside the softmax,
  so the net scale is the same one;
- GQA: key and value repeated per query group (`repeat_interleave` on the head dim, as Megatron does);
- masking: a given boolean `attention_mask` (True = masked out, Megatron's convention) alone, else causal for
  AttnMaskType.causal (sq == sk), else none. A row whose keys are all masked differs: Megatron fills -10000.0
  and averages every value, SDPA does not; our model path never passes a mask (qwen3_moe/forward.py
  `run_schedule` gives `None`: one right-padded sequence per row, the causal mask keeps real tokens exact);
- dropout: `attention_dropout` (else config.attention_dropout) in training only, drawn from the
  model-parallel RNG tracker unless sequence parallel, as Megatron's.
Refused in one line, as Megatron refuses them or has no such path here: packed sequences (thd), an attention
bias, context parallelism, sliding windows, softmax types other than vanilla.

Kernels by name: on CUDA SDPA may choose only flash, cuDNN or memory-efficient attention (`cuda_kernels`,
under torch.nn.attention.sdpa_kernel); where none of them takes the inputs torch raises, so the O(s^2) math
fallback can never run silently. GQA is expanded here rather than passed as `enable_gqa`: torch's
memory-efficient kernel (the only fused one for float32, which the parity checks run) refuses grouped heads;
the copy is [b, np, s, hn] per layer, small beside the s^2 it replaces. On CPU any backend (all exact enough
for the float32 parity with transformers).

For the planner (gspo_mcore.planner.memory_model, fused attention): a layer's attention keeps q, k and v as
expanded here (q-sized each), the output and a float32 [b, np, s] log-sum-exp: 2 * (q - kv) values per token
more than grouped k and v (30B: 7,168 per token per layer over TP). With full recompute (every GPU config)
that is in the one layer being recomputed; without it, in every layer.

The module holds no parameters and no Qwen3 specifics: any spec built on Megatron's SelfAttention can use it.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide
from torch.nn.attention import SDPBackend, sdpa_kernel

from gspo_mcore.common.errors import InputError

# The fused kernels: none materialises the [b, heads, sq, sk] scores. MATH is left out on purpose.
CUDA_KERNELS = (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)


def cuda_kernels(device: torch.device) -> list[SDPBackend] | None:
    """The SDPA backends allowed on `device`: the fused ones on CUDA, None (torch's choice) elsewhere."""
    return list(CUDA_KERNELS) if device.type == "cuda" else None


def kernel_scope(device: torch.device):
    """The context an attention call on `device` runs in: SDPA restricted to `cuda_kernels(device)`."""
    kernels = cuda_kernels(device)
    return sdpa_kernel(kernels) if kernels is not None else contextlib.nullcontext()


class ScaledDotProductAttention(MegatronModule):
    """`DotProductAttention`'s interface computed by torch's fused SDPA (see the module docstring)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        super().__init__(config=config)
        _refuse_unsupported(config, layer_number)
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        tp = self.tp_group.size()
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp)
        self.hidden_size_per_partition = divide(config.kv_channels * config.num_attention_heads, tp)
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> torch.Tensor:
        """query [sq, b, np, hn], key / value [sk, b, ng, hn] on one device -> [sq, b, np * hn] there."""
        if packed_seq_params is not None:
            raise InputError("attention: packed sequences (thd) need Transformer Engine's attention (model.spec: te)")
        if attention_bias is not None:
            raise InputError("attention: an attention bias is not supported (Megatron's DotProductAttention has none)")
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        # [s, b, heads, hn] -> [b, heads, s, hn], SDPA's layout (views; the kernels take any head stride).
        query, key, value = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if groups > 1:
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        mask, causal = self._mask(attention_mask, attn_mask_type or self.attn_mask_type, query.shape[2], key.shape[2])
        dropout_p = self.dropout_p if self.training else 0.0
        # Megatron's DotProductAttention draws attention dropout from the model-parallel RNG stream (different on
        # each TP rank, whose heads differ) unless sequence parallel; SDPA draws from the device's default
        # generator, which the tracker's fork sets.
        fork = dropout_p > 0 and not self.config.sequence_parallel
        with tensor_parallel.get_cuda_rng_tracker().fork() if fork else contextlib.nullcontext():
            with kernel_scope(query.device):
                context = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout_p,
                                                         is_causal=causal, scale=self.softmax_scale)
        # [b, np, sq, hn] -> [sq, b, np * hn]
        return context.permute(2, 0, 1, 3).reshape(context.shape[2], context.shape[0], self.hidden_size_per_partition)

    @staticmethod
    def _mask(attention_mask, mask_type: AttnMaskType, sq: int, sk: int) -> tuple[Optional[torch.Tensor], bool]:
        """(SDPA's attn_mask, is_causal) for Megatron's (attention_mask, mask type)."""
        if attention_mask is not None:
            if attention_mask.dtype != torch.bool:
                raise InputError(f"attention: attention_mask must be boolean (True = masked out), not "
                                 f"{attention_mask.dtype}")
            return ~attention_mask, False  # SDPA's True means "takes part"
        if mask_type == AttnMaskType.causal:
            if sq != sk:
                raise InputError(f"attention: a causal mask needs as many queries as keys, not {sq} and {sk}")
            return None, sq > 1
        if mask_type == AttnMaskType.no_mask:
            return None, False
        raise InputError(f"attention: mask type {mask_type.name} needs an attention_mask")


def _refuse_unsupported(config: TransformerConfig, layer_number: int) -> None:
    """What Megatron's DotProductAttention refuses or this module has no path for, in one line each."""
    if config.context_parallel_size != 1:
        raise InputError("attention: context parallelism needs Transformer Engine's attention (model.spec: te)")
    if config.softmax_type != "vanilla":
        raise InputError(f"attention: softmax_type {config.softmax_type!r} is not supported, only 'vanilla'")
    if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
        raise InputError("attention: sliding-window attention is not supported")
