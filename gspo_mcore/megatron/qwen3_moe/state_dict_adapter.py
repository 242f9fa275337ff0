"""Hugging Face <-> Megatron-Core names and layouts for Qwen3-MoE, as one table.

Works on full (unsharded) tensors and global layer/expert indices; pure torch, no
Megatron import, so the checkpoint converter and the trainer share it. `shard`/`unshard`
give one rank's slice; which rank holds what is read from Megatron's parallel state in
`gspo_mcore.megatron.qwen3_moe.parallel_weights`.

Each rule maps one Megatron tensor to the Hugging Face tensors it is made of:
- COPY: the same tensor under another name.
- QKV:  q_proj, k_proj, v_proj fused into `linear_qkv`, interleaved per query group
        ([q heads of group g, k of g, v of g] for g in groups): the layout Megatron's
        SelfAttention splits with `get_query_key_value_tensors`.
- GLU:  gate_proj and up_proj stacked into `linear_fc1` ([gate; up]): Megatron's
        gated linear unit chunks fc1's output in two and applies silu to the first half.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from gspo_mcore.megatron.qwen3_moe.hf_config import Qwen3MoeArch

COPY, QKV, GLU = "copy", "qkv", "glu"
SPECS = ("te", "local", "torch")
# The `torch` spec's experts stack a layer's local experts in one tensor per linear; parallel_weights hands
# each expert's slice over under the `local` spec's name (TorchGroupedMLP.expert_weights), so its names are local's.
_NAMES_OF = {"torch": "local"}


@dataclass(frozen=True)
class Rule:
    mcore: str
    hf: tuple[str, ...]
    kind: str


# (Megatron name per spec, Hugging Face names, kind). "{layer}"/"{expert}" are global indices.
_Name = dict[str, str] | str
_TOP: list[tuple[_Name, tuple[str, ...], str]] = [
    ("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), COPY),
    ("decoder.final_layernorm.weight", ("model.norm.weight",), COPY),
]
_OUTPUT = ("output_layer.weight", ("lm_head.weight",), COPY)  # absent when embeddings are tied
_ATTENTION = [
    (
        {"local": "input_layernorm.weight", "te": "self_attention.linear_qkv.layer_norm_weight"},
        ("input_layernorm.weight",),
        COPY,
    ),
    (
        "self_attention.linear_qkv.weight",
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        QKV,
    ),
    ("self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",), COPY),
    ("self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",), COPY),
    ("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), COPY),
]
_DENSE_MLP = [
    (
        {"local": "pre_mlp_layernorm.weight", "te": "mlp.linear_fc1.layer_norm_weight"},
        ("post_attention_layernorm.weight",),
        COPY,
    ),
    ("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), GLU),
    ("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), COPY),
]
_MOE = [
    ("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), COPY),
    ("mlp.router.weight", ("mlp.gate.weight",), COPY),
]
_EXPERT = [
    (
        {
            "local": "mlp.experts.local_experts.{expert}.linear_fc1.weight",
            "te": "mlp.experts.linear_fc1.weight{expert}",  # TEGroupedMLP
        },
        ("mlp.experts.{expert}.gate_proj.weight", "mlp.experts.{expert}.up_proj.weight"),
        GLU,
    ),
    (
        {
            "local": "mlp.experts.local_experts.{expert}.linear_fc2.weight",
            "te": "mlp.experts.linear_fc2.weight{expert}",
        },
        ("mlp.experts.{expert}.down_proj.weight",),
        COPY,
    ),
]
MCORE_LAYER_PREFIX = "decoder.layers.{layer}."
HF_LAYER_PREFIX = "model.layers.{layer}."


def _rule(row, spec: str, mcore_prefix: str = "", hf_prefix: str = "", **index) -> Rule:
    mcore, hf, kind = row
    mcore = mcore[_NAMES_OF.get(spec, spec)] if isinstance(mcore, dict) else mcore
    return Rule(
        (mcore_prefix + mcore).format(**index),
        tuple((hf_prefix + name).format(**index) for name in hf),
        kind,
    )


def layer_rules(arch: Qwen3MoeArch, spec: str, layer: int) -> list[Rule]:
    """Rules of one decoder layer (global index): the unit a streaming converter works in."""
    if spec not in SPECS:
        raise ValueError(f"spec {spec!r} is not one of {SPECS}")
    prefixes = dict(mcore_prefix=MCORE_LAYER_PREFIX, hf_prefix=HF_LAYER_PREFIX, layer=layer)
    rules = [_rule(row, spec, **prefixes) for row in _ATTENTION]
    if not arch.moe_layers[layer]:
        return rules + [_rule(row, spec, **prefixes) for row in _DENSE_MLP]
    rules += [_rule(row, spec, **prefixes) for row in _MOE]
    for expert in range(arch.num_experts):
        rules += [_rule(row, spec, expert=expert, **prefixes) for row in _EXPERT]
    return rules


def non_layer_rules(arch: Qwen3MoeArch, spec: str) -> list[Rule]:
    rows = _TOP if arch.tie_word_embeddings else _TOP + [_OUTPUT]
    return [_rule(row, spec) for row in rows]


def all_rules(arch: Qwen3MoeArch, spec: str) -> list[Rule]:
    rules = non_layer_rules(arch, spec)
    for layer in range(arch.num_layers):
        rules += layer_rules(arch, spec, layer)
    return rules


def rule_index(arch: Qwen3MoeArch, spec: str) -> dict[str, Rule]:
    """Megatron name -> rule. With tied embeddings, a last pipeline stage that is not the
    first holds its own copy of the embedding as `output_layer.weight`: map it too."""
    index = {rule.mcore: rule for rule in all_rules(arch, spec)}
    if arch.tie_word_embeddings:
        index[_OUTPUT[0]] = Rule(_OUTPUT[0], ("model.embed_tokens.weight",), COPY)
    return index


def hf_shape(arch: Qwen3MoeArch, name: str) -> tuple[int, ...]:
    """The shape a Hugging Face tensor of this architecture must have."""
    a = arch
    q, kv, hidden = a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim, a.hidden_size
    ffn = a.moe_intermediate_size if ".experts." in name else a.intermediate_size
    by_suffix = {
        "embed_tokens.weight": (a.vocab_size, hidden),
        "lm_head.weight": (a.vocab_size, hidden),
        "norm.weight": (hidden,),
        "layernorm.weight": (hidden,),
        "q_norm.weight": (a.head_dim,),
        "k_norm.weight": (a.head_dim,),
        "q_proj.weight": (q, hidden),
        "k_proj.weight": (kv, hidden),
        "v_proj.weight": (kv, hidden),
        "o_proj.weight": (hidden, q),
        "mlp.gate.weight": (a.num_experts, hidden),
        "gate_proj.weight": (ffn, hidden),
        "up_proj.weight": (ffn, hidden),
        "down_proj.weight": (hidden, ffn),
    }
    for suffix, shape in by_suffix.items():
        if name.endswith(suffix) and (suffix != "norm.weight" or name == "model.norm.weight"):
            return shape
    raise KeyError(f"'{name}' is not a Qwen3-MoE tensor")


# ---- layouts -------------------------------------------------------------------------


def fuse(rule: Rule, arch: Qwen3MoeArch, hf_tensors: list[torch.Tensor]) -> torch.Tensor:
    """Hugging Face tensors of one rule -> the Megatron tensor."""
    if rule.kind == COPY:
        return hf_tensors[0]
    if rule.kind == GLU:
        return torch.cat(hf_tensors, dim=0)
    q, k, v = hf_tensors
    groups, hidden = arch.num_key_value_heads, q.shape[-1]
    return torch.cat(
        [q.reshape(groups, -1, hidden), k.reshape(groups, -1, hidden), v.reshape(groups, -1, hidden)],
        dim=1,
    ).reshape(-1, hidden)


def split(rule: Rule, arch: Qwen3MoeArch, tensor: torch.Tensor) -> list[torch.Tensor]:
    """The Megatron tensor of one rule -> its Hugging Face tensors (inverse of `fuse`)."""
    if rule.kind == COPY:
        return [tensor]
    if rule.kind == GLU:
        return list(tensor.chunk(2, dim=0))
    groups, hidden, head_dim = arch.num_key_value_heads, tensor.shape[-1], arch.head_dim
    q_per_group = arch.num_attention_heads // groups * head_dim
    per_group = tensor.reshape(groups, -1, hidden)
    q, k, v = per_group.split([q_per_group, head_dim, head_dim], dim=1)
    return [t.reshape(-1, hidden) for t in (q, k, v)]


def shard(full: torch.Tensor, kind: str, dim: int, world: int, rank: int) -> torch.Tensor:
    """This rank's slice of a full Megatron tensor. A fused [gate; up] fc1 is split per
    half, so every rank holds [gate_r; up_r], the layout Megatron's GLU expects."""
    if world == 1:
        return full
    if kind == GLU:
        return torch.cat([half.chunk(world, dim)[rank] for half in full.chunk(2, dim)], dim)
    return full.chunk(world, dim)[rank]


def unshard(shards: list[torch.Tensor], kind: str, dim: int) -> torch.Tensor:
    """Inverse of `shard` given every rank's slice in rank order."""
    if len(shards) == 1:
        return shards[0]
    if kind == GLU:
        halves = [s.chunk(2, dim) for s in shards]
        return torch.cat([torch.cat([h[0] for h in halves], dim), torch.cat([h[1] for h in halves], dim)], dim)
    return torch.cat(shards, dim)


def hf_to_mcore(
    arch: Qwen3MoeArch, rules: list[Rule], get_hf: Callable[[str], torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    for rule in rules:
        yield rule.mcore, fuse(rule, arch, [get_hf(name) for name in rule.hf])


def mcore_to_hf(
    arch: Qwen3MoeArch, rules: list[Rule], get_mcore: Callable[[str], torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    for rule in rules:
        yield from zip(rule.hf, split(rule, arch, get_mcore(rule.mcore)))
