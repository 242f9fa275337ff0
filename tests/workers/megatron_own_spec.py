"""Load a converted checkpoint the way a Megatron user does: GPTModel built from megatron-core's
own spec functions (not gspo_mcore.models), a default (strict) dist_checkpointing.load, then
logits against transformers. Prints one JSON line per spec.

    python tests/workers/megatron_own_spec.py HF_DIR MCORE_DIR
"""

import dataclasses
import json
import sys
from pathlib import Path

import torch
from megatron.core import dist_checkpointing
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from gspo_mcore.config import DistributedConfig, ModelConfig
from gspo_mcore.megatron.qwen3_moe.hf_config import load_hf_config
from gspo_mcore.megatron.qwen3_moe.model import transformer_config
from gspo_mcore.megatron.parallel import init_distributed
from gspo_mcore.megatron.parity import compare, hf_logits, sample_tokens


def specs(config, arch):
    """The block spec, and per-layer local specs (one layer spec alone would make every layer MoE)."""
    dense = get_gpt_layer_local_spec(num_experts=None, qk_layernorm=True, normalization="RMSNorm")
    moe = get_gpt_layer_local_spec(num_experts=arch.num_experts, moe_grouped_gemm=False, qk_layernorm=True,
                                   normalization="RMSNorm")
    return {"get_gpt_decoder_block_spec": get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                                                       normalization="RMSNorm"),
            "get_gpt_layer_local_spec": TransformerBlockSubmodules(
                layer_specs=[moe if is_moe else dense for is_moe in arch.moe_layers], layer_norm=WrappedTorchNorm)}


def main(hf_dir: str, mcore_dir: str) -> None:
    init_distributed(DistributedConfig(), seed=0)
    arch = load_hf_config(Path(hf_dir))
    config = dataclasses.replace(transformer_config(arch, ModelConfig(), DistributedConfig()), moe_grouped_gemm=False)
    tokens = sample_tokens(arch.vocab_size, batch=2, seq_len=12, seed=0)
    reference = hf_logits(hf_dir, tokens)
    for name, spec in specs(config, arch).items():
        model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=arch.vocab_size,
                         max_sequence_length=arch.max_position_embeddings, pre_process=True, post_process=True,
                         share_embeddings_and_output_weights=arch.tie_word_embeddings, position_embedding_type="rope",
                         rotary_percent=1.0, rotary_base=arch.rope_theta, parallel_output=True)
        sharded = model.sharded_state_dict()
        loaded = dist_checkpointing.load(sharded, str(Path(mcore_dir) / "release"))  # default strictness
        model.load_state_dict({k: loaded[k] for k in sharded}, strict=True)
        model.eval()
        with torch.no_grad():
            positions = torch.arange(tokens.shape[1])[None].expand_as(tokens)
            logits = model(input_ids=tokens, position_ids=positions, attention_mask=None)
        print(json.dumps({"spec": name, **compare(reference, logits)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
