"""Move weights between Hugging Face tensors and a TP/EP/PP-sharded Megatron model.

Which slice a rank holds is read from Megatron itself: each parameter's
`tensor_model_parallel` / `partition_dim` attributes, its layer's global `layer_number`,
and the TP / expert-TP / EP ranks in `parallel_state`. The `torch` spec's stacked expert
weights (TorchGroupedMLP) are moved one expert's view at a time, under the `local` spec's
names and in its order, so every spec loads and exports the same tensors in the same order.
"""

from __future__ import annotations

import re
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from gspo_mcore.common.errors import CheckpointError
from gspo_mcore.megatron.qwen3_moe.experts import TorchGroupedMLP
from gspo_mcore.megatron.qwen3_moe.hf_config import Qwen3MoeArch
from gspo_mcore.megatron.qwen3_moe.state_dict_adapter import fuse, hf_shape, rule_index, shard, split, unshard

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"(local_experts\.|\.weight)(\d+)(\.|$)")


def _is_expert(name: str) -> bool:
    # By name: Megatron's `allreduce=False` marks expert params only when EP > 1.
    return ".mlp.experts." in name


def _tp_group(name: str, param: torch.nn.Parameter):
    """(group, world, rank) this parameter (or a view of one) is sharded over, or None if it is not."""
    if not getattr(param, "tensor_model_parallel", False):
        return None
    if _is_expert(name):
        return (
            parallel_state.get_expert_tensor_parallel_group(),
            parallel_state.get_expert_tensor_parallel_world_size(),
            parallel_state.get_expert_tensor_parallel_rank(),
        )
    return (
        parallel_state.get_tensor_model_parallel_group(),
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_rank(),
    )


def _global_name(model, name: str, num_experts: int) -> str:
    """Local parameter name -> name in the full model (global layer and expert index)."""
    match = _LAYER.match(name)
    if match:
        layer = model.decoder.layers[int(match.group(1))]
        name = f"decoder.layers.{layer.layer_number - 1}." + name[match.end():]
    if _is_expert(name):
        local_experts = num_experts // parallel_state.get_expert_model_parallel_world_size()
        offset = parallel_state.get_expert_model_parallel_rank() * local_experts
        name = _LOCAL_EXPERT.sub(lambda m: f"{m.group(1)}{int(m.group(2)) + offset}{m.group(3)}", name)
    return name


def _local_weights(model):
    """(local name, tensor, the parameter it is or is a view of, its TP partition dim) of each tensor the
    mapping table names: every parameter, except that a TorchGroupedMLP's stacks come as its per-expert views
    (`expert_weights`) where its first parameter would."""
    grouped = {name: module for name, module in model.named_modules() if isinstance(module, TorchGroupedMLP)}
    done = set()
    for name, param in model.named_parameters():
        module_name = name.rpartition(".")[0]
        if module_name not in grouped:
            yield name, param, param, getattr(param, "partition_dim", None)
        elif module_name not in done:
            done.add(module_name)
            for suffix, view, stacked, partition_dim in grouped[module_name].expert_weights():
                yield f"{module_name}.{suffix}", view, stacked, partition_dim


def _named_rules(model, arch: Qwen3MoeArch, spec: str):
    """(tensor, its rule, the group it is TP-sharded over or None, its partition dim) for each local
    tensor (`_local_weights`: a parameter or a view of one)."""
    index = rule_index(arch, spec)
    for name, tensor, param, partition_dim in _local_weights(model):
        global_name = _global_name(model, name, arch.num_experts)
        if global_name not in index:
            raise KeyError(f"no Hugging Face tensor maps to Megatron parameter '{global_name}'")
        yield tensor, index[global_name], _tp_group(name, param), partition_dim


@torch.no_grad()
def load_hf_weights(model, arch: Qwen3MoeArch, spec: str, get_hf: Callable[[str], torch.Tensor]) -> None:
    """Fill this rank's parameters of `model` (an unwrapped GPTModel) from HF tensors."""
    for param, rule, group, partition_dim in _named_rules(model, arch, spec):
        try:
            full = fuse(rule, arch, [get_hf(name) for name in rule.hf])
        except RuntimeError:  # reshape/cat of wrongly shaped inputs
            shapes = {name: list(get_hf(name).shape) for name in rule.hf}
            raise CheckpointError(f"tensors {shapes} do not fit Megatron's {rule.mcore}") from None
        local = full if group is None else shard(full, rule.kind, partition_dim, group[1], group[2])
        if local.shape != param.shape:
            found = {name: list(get_hf(name).shape) for name in rule.hf}
            expected = list(param.shape) if group is None else f"{list(param.shape)} on each of {group[1]} ranks"
            raise CheckpointError(f"tensor shapes {found} give {rule.mcore} {list(full.shape)}, expected {expected}")
        param.copy_(local)


@torch.no_grad()
def export_hf_weights(model, arch: Qwen3MoeArch, spec: str) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named full tensors of the parameters this rank's pipeline stage and experts hold,
    gathered over TP / expert-TP. Collective: every rank of a TP group must iterate it."""
    for param, rule, group, partition_dim in _named_rules(model, arch, spec):
        if arch.tie_word_embeddings and rule.mcore == "output_layer.weight":
            continue  # the last stage's copy of the tied embedding
        if group is None or group[1] == 1:
            full = param.detach()
        else:
            shards = [torch.empty_like(param) for _ in range(group[1])]
            dist.all_gather(shards, param.detach().contiguous(), group=group[0])
            full = unshard(shards, rule.kind, partition_dim)
        yield from zip(rule.hf, split(rule, arch, full))


def owns(hf_name: str) -> bool:
    """One canonical holder of each tensor among its replicas: TP rank 0 and DP rank 0
    (expert-TP / expert-DP rank 0 for experts)."""
    if _is_expert(hf_name):
        return (parallel_state.get_expert_tensor_parallel_rank() == 0
                and parallel_state.get_expert_data_parallel_rank() == 0)
    return (parallel_state.get_tensor_model_parallel_rank() == 0
            and parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0)


def owned_hf_weights(model, arch: Qwen3MoeArch, spec: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Like `export_hf_weights`, but each tensor comes out on exactly one rank of the whole
    job: together the ranks give every Hugging Face tensor once (weight sync, HF export).
    Collective like `export_hf_weights`: every rank must iterate it."""
    for name, tensor in export_hf_weights(model, arch, spec):
        if owns(name):
            yield name, tensor


def owned_hf_plan(model, arch: Qwen3MoeArch, spec: str) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(name, dtype, shape) of what `owned_hf_weights` will yield here, in that order, without
    moving any data."""
    plan = []
    for param, rule, _, _ in _named_rules(model, arch, spec):
        if arch.tie_word_embeddings and rule.mcore == "output_layer.weight":
            continue
        plan += [(name, param.dtype, hf_shape(arch, name)) for name in rule.hf if owns(name)]
    return plan
