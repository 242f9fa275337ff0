"""Load a Hugging Face checkpoint and its converted Megatron-Core checkpoint on CPU and
compare logits on fixed prompts and every weight. Needs memory for both models in float32."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from checkpoint_convert.convert import check_model_keys
from checkpoint_convert.dcp_io import DCPReader
from gspo_mcore.megatron.checkpointing import checkpoint_dir, load_model_weights
from gspo_mcore.config import DistributedConfig, ModelConfig
from gspo_mcore.common.errors import InputError
from gspo_mcore.megatron.qwen3_moe.forward import megatron_logits
from gspo_mcore.megatron.qwen3_moe.hf_config import load_hf_config
from gspo_mcore.megatron.qwen3_moe.model import build_model
from gspo_mcore.megatron.qwen3_moe.parallel_weights import export_hf_weights
from gspo_mcore.megatron.parallel import init_distributed
from gspo_mcore.megatron.parity import compare, hf_logits, sample_tokens
from gspo_mcore.common.safetensors_io import HFCheckpointReader

TOLERANCE = 1e-4  # max |logit difference|; both sides run float32 on identical weights
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def verify(hf_dir, mcore_dir, batch: int = 4, seq_len: int = 32) -> dict:
    if torch.cuda.is_available():
        raise InputError("verify runs on the CPU (the local spec, float32): start it with CUDA_VISIBLE_DEVICES=''")
    hf_dir = Path(hf_dir)
    arch = load_hf_config(hf_dir)
    ckpt = checkpoint_dir(mcore_dir)

    check_model_keys(DCPReader(ckpt), arch, hf_dir)  # a checkpoint with more layers is not "ok"
    dist_cfg = DistributedConfig(device="cpu")
    init_distributed(dist_cfg, seed=0)
    model = build_model(arch, ModelConfig(hf_dir=str(hf_dir), spec="local", dtype="float32"), dist_cfg)
    load_model_weights(model, ckpt)
    model.eval()

    # Both sides see the HF weights rounded to the checkpoint's dtype (a --dtype conversion
    # is lossy by request); everything then runs in float32.
    stored = DCPReader(ckpt).metadata.state_dict_metadata["embedding.word_embeddings.weight"].properties.dtype
    reader = HFCheckpointReader(hf_dir)
    per_layer: dict[str, float] = {}
    for name, tensor in export_hf_weights(model, arch, "local"):
        match = _LAYER.match(name)
        where = f"layer_{match[1]}" if match else "embeddings_norm_head"
        diff = (tensor - reader[name].to(stored).float()).abs().max().item()
        per_layer[where] = max(per_layer.get(where, 0.0), diff)

    tokens = sample_tokens(arch.vocab_size, batch, seq_len, seed=0)
    figures = compare(hf_logits(str(hf_dir), tokens, weight_dtype=stored), megatron_logits(model, tokens))
    figures.pop("logit_std")
    figures["per_layer_max_weight_diff"] = per_layer
    # What the figures mean: the HF weights were rounded to this dtype before both comparisons.
    figures["weights_rounded_to"] = str(stored).removeprefix("torch.")
    figures["tolerance"] = TOLERANCE
    figures["ok"] = figures["max_abs_logit_diff"] <= TOLERANCE and max(per_layer.values()) == 0.0
    return figures
