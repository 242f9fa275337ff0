"""FLOPs the rehearsed rank runs, by kind, counted op by op (hardware FLOPs: the recompute's forward
and the fused log-probs' second GEMM included), beside gspo_mcore.planner.flops.

Conventions: a GEMM is 2 x m x n x k (torch.utils.flop_counter's formulas for mm, addmm, bmm,
baddbmm; `_grouped_mm`, which has none there, is 2 x tokens x n x k over its groups). Attention is
the planner's: causal (half the square: 2 x 2 x s x s x width / 2 a layer forward) and backward 2 x
forward; torch.utils.flop_counter counts the full square and a 2.5 x backward, which is not what a
causal flash kernel runs. Kinds by the operands' shapes, the arch's own widths: `output` a GEMM
with the vocabulary (over TP) as a dimension, `experts` the grouped GEMMs and GEMMs with the expert
FFN width, `attention` the SDPA kernels, `dense` the rest (QKV, O, the router, a dense MLP).
"""

from __future__ import annotations

import sys

import torch
from torch.utils.flop_counter import flop_registry

aten = torch.ops.aten
KINDS = ("dense", "experts", "attention", "output")
_ATTENTION_FORWARD = {aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_efficient_attention,
                      aten._scaled_dot_product_cudnn_attention, aten._scaled_dot_product_flash_attention_for_cpu}
_ATTENTION_BACKWARD = {aten._scaled_dot_product_flash_attention_backward,
                       aten._scaled_dot_product_efficient_attention_backward,
                       aten._scaled_dot_product_cudnn_attention_backward,
                       aten._scaled_dot_product_flash_attention_for_cpu_backward}
OUTPUT_MODULE = "gspo_mcore/gspo/logprobs.py"
_GEMMS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm}


def causal_attention_flops(query_shape, causal: bool = True) -> float:
    """Forward FLOPs of one SDPA call, query [b, heads, s, d] (keys of the same length)."""
    b, heads, s, d = query_shape
    return 2 * 2 * b * heads * s * s * d / (2 if causal else 1)


def _in_output_layer(depth_limit: int = 30) -> bool:
    """Called from the fused log-probs (a block of the vocabulary at a time: no full-vocabulary
    dimension), forward or its Python backward."""
    frame = sys._getframe(2)
    for _ in range(depth_limit):
        if frame is None:
            return False
        if frame.f_code.co_filename.endswith(OUTPUT_MODULE):
            return True
        frame = frame.f_back
    return False


class FlopCounter:
    def __init__(self, vocab_per_rank: int, expert_widths: set[int]):
        self.vocab, self.expert_widths = vocab_per_rank, expert_widths
        self.by_kind = dict.fromkeys(KINDS, 0.0)

    def count(self, func, args, kwargs, out) -> None:
        packet = func.overloadpacket
        if packet in _ATTENTION_FORWARD or packet in _ATTENTION_BACKWARD:
            causal = kwargs.get("is_causal", args[4] if packet is aten._scaled_dot_product_flash_attention
                                and len(args) > 4 else True)
            forward = causal_attention_flops(tuple(args[0].shape), bool(causal))
            self.by_kind["attention"] += forward * (2 if packet in _ATTENTION_BACKWARD else 1)
            return
        if packet is aten._grouped_mm:
            a, b = args[0], args[1]
            flops = 2 * a.shape[0] * a.shape[-1] * b.shape[-1]  # every row of a meets one group's [k, n]
            self.by_kind["experts"] += flops
            return
        if packet not in _GEMMS:
            return
        flops = flop_registry[packet](*args, **kwargs, out_val=out)
        shapes = {d for t in args if isinstance(t, torch.Tensor) for d in t.shape}
        if self.vocab in shapes or _in_output_layer():
            kind = "output"
        elif shapes & self.expert_widths:
            kind = "experts"
        else:
            kind = "dense"
        self.by_kind[kind] += flops

    def reset(self) -> None:
        self.by_kind = dict.fromkeys(KINDS, 0.0)
