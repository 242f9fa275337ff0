"""Hugging Face vs Megatron-Core logits on the same tokens, under any parallel layout.

`python -m gspo_mcore.megatron.parity --config FILE [key=value ...]` (plain python or torchrun)
prints one JSON line with the figures; the tests and `make demo` use the same functions.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from gspo_mcore.megatron.checkpointing import load_model_weights
from gspo_mcore.config import Config, load_config
from gspo_mcore.common.errors import run_cli
from gspo_mcore.megatron.qwen3_moe.bootstrap import model_from_config
from gspo_mcore.megatron.qwen3_moe.forward import megatron_logits
from gspo_mcore.megatron.qwen3_moe.hf_config import load_hf_config
from gspo_mcore.megatron.qwen3_moe.parallel_weights import export_hf_weights
from gspo_mcore.common.safetensors_io import HFCheckpointReader


@torch.no_grad()
def hf_logits(hf_dir: str, tokens: torch.Tensor, weight_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """transformers' logits in float32, with the weights first rounded to `weight_dtype`."""
    from transformers import AutoModelForCausalLM  # heavy (seconds): only the HF side of a parity check

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=weight_dtype).float()
    return model(input_ids=tokens).logits


def compare(reference: torch.Tensor, logits: torch.Tensor) -> dict:
    diff = (reference.float() - logits.float()).abs()
    return {
        "max_abs_logit_diff": diff.max().item(),
        "mean_abs_logit_diff": diff.mean().item(),
        "top1_agreement": (reference.argmax(-1) == logits.argmax(-1)).float().mean().item(),
        "logit_std": reference.float().std().item(),
    }


def sample_tokens(vocab_size: int, batch: int = 4, seq_len: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(seed))


def run(config: Config, tokens: torch.Tensor, mcore_dir: str | None = None,
        reference: torch.Tensor | None = None) -> dict | None:
    """Build the model under `config.distributed`, load the HF weights (or the converted
    torch_dist checkpoint `mcore_dir`), compare logits and the exported weights with the
    checkpoint (`reference`: transformers' logits for `tokens`, when the caller has them already).
    Returns the figures on global rank 0, None on other ranks."""
    arch, model = model_from_config(config, load_weights=not mcore_dir)
    if mcore_dir:
        load_model_weights(model, mcore_dir)
    model.eval()
    reader = HFCheckpointReader(config.model.hf_dir)
    logits = megatron_logits(model, tokens)
    if logits is not None:
        reference = hf_logits(config.model.hf_dir, tokens) if reference is None else reference
        figures = compare(reference, logits.cpu())
    else:
        figures = None
    # Export back (gathering TP shards): bitwise equal to the file, and all ranks together
    # give back every tensor of the checkpoint.
    exported, identical = set(), True
    for name, tensor in export_hf_weights(model, arch, config.model.spec):
        exported.add(name)
        identical &= torch.equal(tensor.cpu(), reader[name])
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (figures, exported, identical))
    figures = next(f for f, _, _ in gathered if f is not None)  # from a last pipeline stage
    all_exported = set().union(*(names for _, names, _ in gathered))
    figures["export_bitwise_identical"] = all(ok for _, _, ok in gathered) and all_exported == set(reader.keys())
    d = config.distributed
    figures["layout"] = (
        f"TP={d.tensor_parallel} PP={d.pipeline_parallel} EP={d.expert_parallel} "
        f"ETP={d.expert_tensor_parallel} DP={parallel_state.get_data_parallel_world_size()} "
        f"world={dist.get_world_size()}"
    )
    return figures if dist.get_rank() == 0 else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="YAML config (model / distributed sections)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--mcore-dir", help="load this torch_dist checkpoint instead of the HF weights")
    parser.add_argument("overrides", nargs="*", help="key=value, e.g. distributed.expert_parallel=2")
    args = parser.parse_intermixed_args()
    config = load_config(args.config, args.overrides)
    arch = load_hf_config(config.model.hf_dir)
    figures = run(config, sample_tokens(arch.vocab_size, args.batch, args.seq_len), args.mcore_dir)
    if figures is not None:
        print(json.dumps(figures), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
