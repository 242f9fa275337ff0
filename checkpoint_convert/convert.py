"""Hugging Face <-> Megatron-Core torch_dist conversion of Qwen3-MoE, one layer at a time.

Names and layouts come from the mapping table (gspo_mcore.megatron.qwen3_moe.state_dict_adapter);
this module only adds Megatron's checkpoint keys and streams tensors between the files.
Every input check runs before anything is written; output goes to `OUT.tmp-<pid>` and is
renamed to OUT only when complete.
"""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path

import torch

from checkpoint_convert.dcp_io import DCPReader, DCPWriter, TensorStorageMetadata
from checkpoint_convert.progress import Progress
from gspo_mcore.megatron.checkpointing import RELEASE, TRACKER, checkpoint_dir
from gspo_mcore.common.errors import CheckpointError, InputError
from gspo_mcore.common.files import atomic_output
from gspo_mcore.megatron.qwen3_moe.hf_config import Qwen3MoeArch, load_hf_config
from gspo_mcore.megatron.qwen3_moe.state_dict_adapter import (
    COPY,
    GLU,
    Rule,
    fuse,
    hf_shape,
    layer_rules,
    non_layer_rules,
    split,
)
from gspo_mcore.common.processes import pid_running
from gspo_mcore.common.safetensors_io import HFCheckpointReader, HFCheckpointWriter, copy_side_files

# Checkpoint keys are the Transformer Engine spec's names; the local spec maps its own names
# to them (layer_spec.py), so one checkpoint loads into either module set.
CHECKPOINT_SPEC = "te"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
MODEL_MODULES = {"embedding", "decoder", "output_layer"}  # GPTModel's; the rest is optimizer/RNG state
# Megatron stacks the experts of a layer on a leading axis: experts.experts.linear_fc1.weight [E, ...].
_EXPERT = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.)linear_(fc[12])\.weight(\d+)$")


def checkpoint_key(rule: Rule) -> tuple[str, int | None]:
    """(torch_dist key, expert index on its leading axis or None) of a rule's tensor."""
    match = _EXPERT.match(rule.mcore)
    if match:
        return f"{match[1]}experts.linear_{match[2]}.weight", int(match[3])
    return rule.mcore, None


def extra_state_keys(arch: Qwen3MoeArch, layer: int | None) -> list[str]:
    """Megatron saves each linear module's `_extra_state` (None unless FP8) as an object;
    layer None: the non-layer group's. Plus `te_norm_extra_state_keys`."""
    if layer is None:
        return te_norm_extra_state_keys(arch, None)
    prefix = f"decoder.layers.{layer}."
    keys = [f"{prefix}self_attention.linear_proj._extra_state/shard_0_1",
            f"{prefix}self_attention.linear_qkv._extra_state/shard_0_1"]
    if not arch.moe_layers[layer]:
        keys += [f"{prefix}mlp.linear_fc1._extra_state/shard_0_1", f"{prefix}mlp.linear_fc2._extra_state/shard_0_1"]
    else:
        n = arch.num_experts
        keys += [f"{prefix}mlp.experts.experts.linear_{fc}._extra_state/shard_{e}_{n}"
                 for fc in ("fc1", "fc2") for e in range(n)]
    return keys + te_norm_extra_state_keys(arch, layer)


def te_norm_extra_state_keys(arch: Qwen3MoeArch, layer: int | None) -> list[str]:
    """The Transformer Engine spec's standalone norms (TENorm: te.pytorch.RMSNorm, which has an
    `_extra_state`) that the local spec's RMSNorm lacks: the final norm, the q/k norms and an
    MoE layer's pre-MLP norm (the other norms are fused into the next linear, whose extra
    state is above). A te-spec model asks for them on load; the local one ignores them."""
    if layer is None:
        return ["decoder.final_layernorm._extra_state/shard_0_1"]
    prefix = f"decoder.layers.{layer}."
    keys = [f"{prefix}self_attention.{qk}_layernorm._extra_state/shard_0_1" for qk in ("q", "k")]
    return keys + ([f"{prefix}pre_mlp_layernorm._extra_state/shard_0_1"] if arch.moe_layers[layer] else [])


def local_spec_aliases(arch: Qwen3MoeArch, layer: int | None) -> dict[str, str]:
    """Keys Megatron's own local spec (get_gpt_layer_local_spec, get_gpt_decoder_block_spec
    with use_transformer_engine=False) asks for under other names: it maps `pre_mlp_layernorm.`
    to `mlp.linear_fc1.layer_norm_` in MoE layers too, where the TE spec keeps a standalone
    `pre_mlp_layernorm`. alias -> the key written, so both specs load strictly."""
    if layer is None or not arch.moe_layers[layer]:
        return {}
    prefix = f"decoder.layers.{layer}."
    return {f"{prefix}mlp.linear_fc1.layer_norm_weight": f"{prefix}pre_mlp_layernorm.weight"}


def groups(arch: Qwen3MoeArch) -> list[tuple[int | None, list[Rule]]]:
    """The unit of streaming: embeddings/norm/head, then each decoder layer."""
    return [(None, non_layer_rules(arch, CHECKPOINT_SPEC))] + [
        (layer, layer_rules(arch, CHECKPOINT_SPEC, layer)) for layer in range(arch.num_layers)
    ]


def fused_shape(arch: Qwen3MoeArch, rule: Rule) -> tuple[int, ...]:
    shapes = [hf_shape(arch, name) for name in rule.hf]
    if rule.kind == COPY:
        return shapes[0]
    if rule.kind == GLU:
        return (shapes[0][0] + shapes[1][0], shapes[0][1])
    return (sum(s[0] for s in shapes), shapes[0][1])


def checked_output(out: Path, overwrite: bool, inputs: tuple[Path, ...] = ()):
    """`atomic_output(out)` as a directory, after refusing an existing `out` (unless
    `overwrite`), an `out` that is, holds or lies inside an input (`--overwrite` would delete
    it), or a missing parent, before anything is written. Temporaries of earlier runs killed
    on this host (`OUT.tmp-<pid>`, pid gone) are removed."""
    out = Path(out)
    for source in inputs:
        a, b = out.resolve(), Path(source).resolve()
        if a == b or a in b.parents or b in a.parents:
            raise InputError(f"{out}: output directory is, contains or lies inside the input {source}")
    if out.exists() and not overwrite:
        raise InputError(f"{out}: output directory exists (pass --overwrite to replace it)")
    require_parent(out)
    remove_stale_temporaries(out)
    return atomic_output(out, directory=True)


def remove_stale_temporaries(out: Path) -> list[Path]:
    """Remove `OUT.tmp-<pid>` left by converter runs that were killed (their pid is not running
    on this host); return what was removed."""
    removed = []
    for tmp in out.parent.glob(f"{out.name}.tmp-*"):
        pid = tmp.name.rpartition("-")[2]
        if not pid.isdigit() or pid_running(int(pid)):  # ours, or a live process's (another conversion)
            continue
        shutil.rmtree(tmp, ignore_errors=True)
        removed.append(tmp)
    return removed


def check_model_keys(reader: DCPReader, arch: Qwen3MoeArch, config_dir: Path) -> None:
    """Every model tensor of the checkpoint is one the config uses: a config with fewer layers
    or experts would otherwise give a truncated model that verifies as fine."""
    used = {checkpoint_key(rule)[0] for _, rules in groups(arch) for rule in rules}
    used |= {alias for layer in range(arch.num_layers) for alias in local_spec_aliases(arch, layer)}
    for key, meta in reader.metadata.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata) and key.split(".")[0] in MODEL_MODULES and key not in used:
            raise CheckpointError(f"{reader.dir}: tensor '{key}' is not used by {Path(config_dir) / 'config.json'} "
                                  f"({arch.num_layers} layers, {arch.num_experts} experts)")


def require_parent(out: Path) -> None:
    if not Path(out).parent.is_dir():
        raise InputError(f"{Path(out).parent}: parent directory of the output does not exist (mkdir -p it first)")


def check_disk_space(out: Path, needed: int) -> None:
    require_parent(out)  # before the free space of a directory that is not there
    free = shutil.disk_usage(Path(out).parent).free
    margin = 64 << 20
    if free < needed * 1.02 + margin:
        raise InputError(
            f"{Path(out).parent}: not enough disk space ({needed / 1e9:.2f} GB needed, {free / 1e9:.2f} GB free)"
        )


def _validate_hf(arch: Qwen3MoeArch, reader: HFCheckpointReader) -> list[str]:
    """Every expected tensor present with its shape, nothing unexpected. Reads headers only."""
    needed = [name for _, rules in groups(arch) for rule in rules for name in rule.hf]
    for name in needed:
        found, expected = reader.shape(name), list(hf_shape(arch, name))
        if found != expected:
            raise CheckpointError(f"{reader.dir}: tensor '{name}' has shape {found}, expected {expected}")
    unexpected = sorted(set(reader.keys()) - set(needed))
    if unexpected:
        raise CheckpointError(f"{reader.dir}: unexpected tensor '{unexpected[0]}' (not part of this Qwen3-MoE)")
    return needed


def hf_to_mcore(hf_dir, output_dir, dtype: str | None = None, overwrite: bool = False, quiet: bool = False) -> Path:
    hf_dir, output_dir = Path(hf_dir), Path(output_dir)
    arch = load_hf_config(hf_dir)
    reader = HFCheckpointReader(hf_dir)
    names = _validate_hf(arch, reader)
    cast = DTYPES[dtype] if dtype else None
    sizes = {name: math.prod(hf_shape(arch, name)) * (cast or reader.dtype(name)).itemsize for name in names}
    total = sum(sizes.values())
    check_disk_space(output_dir, total)
    with checked_output(output_dir, overwrite, (hf_dir,)) as tmp:
        writer = DCPWriter(tmp / RELEASE)
        progress = Progress("hf-to-mcore", len(names), total, quiet)
        for layer, rules in groups(arch):
            writer.start_file()
            aliases = {key: alias for alias, key in local_spec_aliases(arch, layer).items()}
            for rule in rules:
                tensors = [reader[name] for name in rule.hf]
                if cast is not None:
                    tensors = [t.to(cast) for t in tensors]
                fused = fuse(rule, arch, tensors)
                key, expert = checkpoint_key(rule)
                if expert is None:
                    writer.write_tensor(key, fused.shape, (0,) * fused.dim(), fused)
                    if key in aliases:
                        writer.write_tensor(aliases[key], fused.shape, (0,) * fused.dim(), fused)
                else:
                    writer.write_tensor(key, (arch.num_experts, *fused.shape), (expert, 0, 0), fused.unsqueeze(0))
                progress.update(len(rule.hf), sum(sizes[name] for name in rule.hf))
                reader.release()  # unmap what was read: mapped pages count toward RSS
            for key in extra_state_keys(arch, layer):
                writer.write_object(key, None)
        writer.finish({"checkpoint_version": 3.0, "iteration": 0})
        (tmp / TRACKER).write_text(RELEASE)
        progress.close()
    return output_dir


def _read_rule(reader: DCPReader, rule: Rule) -> torch.Tensor:
    key, expert = checkpoint_key(rule)
    return reader.read(key) if expert is None else reader.read(key, (expert,), (1,))[0]


def mcore_to_hf(mcore_dir, hf_config_dir, output_dir, overwrite: bool = False, quiet: bool = False) -> Path:
    hf_config_dir, output_dir = Path(hf_config_dir), Path(output_dir)
    arch = load_hf_config(hf_config_dir)
    reader = DCPReader(checkpoint_dir(mcore_dir))
    plan = groups(arch)
    total, count, shard_plan = 0, 0, []
    for _, rules in plan:
        for rule in rules:
            key, expert = checkpoint_key(rule)
            expected = fused_shape(arch, rule) if expert is None else (arch.num_experts, *fused_shape(arch, rule))
            found = tuple(reader.shape(key))
            if found != expected:
                raise CheckpointError(f"{reader.dir}: tensor '{key}' has shape {list(found)}, expected {list(expected)}")
            dtype = reader.metadata.state_dict_metadata[key].properties.dtype
            total += math.prod(expected[1:] if expert is not None else expected) * dtype.itemsize
            count += len(rule.hf)
            shard_plan += [(name, dtype, hf_shape(arch, name)) for name in rule.hf]
    check_model_keys(reader, arch, hf_config_dir)  # after the shapes: a wrong config is named by its first tensor
    check_disk_space(output_dir, total)
    with checked_output(output_dir, overwrite, (Path(mcore_dir), hf_config_dir)) as tmp:
        writer = HFCheckpointWriter(tmp, shard_plan)
        progress = Progress("mcore-to-hf", count, total, quiet)
        for _, rules in plan:
            for rule in rules:
                full = _read_rule(reader, rule)
                for name, tensor in zip(rule.hf, split(rule, arch, full)):
                    writer.write(name, tensor)
                progress.update(len(rule.hf), full.numel() * full.element_size())
        writer.finish()
        copy_side_files(hf_config_dir, tmp)
        progress.close()
    return output_dir
