"""The FLOPs of a GSPO update, counted once for the planner, the GPU check and the trainer's `mfu` / `hfu`.

Two counts, kept apart:
- model FLOPs, the paper-standard count an MFU is compared by (Narayanan et al. 2021, appendix;
  PaLM, Chowdhery et al. 2022, appendix B): per trained token 6 x the parameters its GEMMs touch
  (the active ones: the router and the top-k experts, the output layer; not the input embedding,
  a lookup) + attention; nothing recomputed, no forward-only pass. The published anchors
  (Megatron-Bridge 30%, NeMo Automodel 28% for Qwen3-30B-A3B on H100) are this count.
- hardware FLOPs, what the GPUs run: the model FLOPs + model.recompute full's second forward of
  the decoder layers in backward, model.fused_logprobs' second output-layer GEMM in backward, and
  the forward-only passes of the batch the step makes (pi_old / pi_prox, strict exactness, the KL
  reference: gspo_mcore.planner.costs.forward_passes).
Pure arithmetic on the shapes: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from gspo_mcore.config import Config
from gspo_mcore.megatron.qwen3_moe.hf_config import Qwen3MoeArch
from gspo_mcore.planner.memory_model import param_counts

# Dense bf16 peaks (FLOP/s, no sparsity) by torch.cuda.get_device_name's wording, the first match
# wins: the PCIe and NVL H100s clock lower than the SXM.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12))
H100_BF16_FLOPS = 989e12  # the planner's times and the GPU check's figures assume an H100 SXM


@dataclass(frozen=True)
class Flops:
    model: float  # the paper-standard count an MFU divides
    hardware: float  # what runs: an HFU divides it


def peak_flops(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU by its name; None for one not in PEAK_BF16_FLOPS."""
    return next((peak for name, peak in PEAK_BF16_FLOPS if name in device_name), None)


def gemm_params(arch: Qwen3MoeArch) -> dict[str, int]:
    """Parameters a token's GEMMs touch: the decoder layers' active ones (attention, the router, the
    top-k experts or the dense MLP; their norms, a rounding error, counted too) and the output layer."""
    h, output = arch.hidden_size, arch.vocab_size * arch.hidden_size
    embeddings = output * (1 if arch.tie_word_embeddings else 2) + h  # + the final norm
    return {"layers": param_counts(arch)["active"] - embeddings, "output": output}


def attention_forward(arch: Qwen3MoeArch, length: int) -> float:
    """Forward FLOPs of causal attention's two GEMMs (Q K^T and the weights times V) over one
    sequence: 2 x 2 x width a (query, key) pair a layer, the width Qwen3's q heads x head_dim
    (4,096 at 30B, twice hidden_size). Causal half: each query meets on average half the sequence,
    as Megatron-LM's count halves it ("only half of the mask is non-zero") and flash attention's
    causal kernels skip the masked blocks; PaLM's 12 x L x H x Q x T is the full square."""
    width = arch.num_attention_heads * arch.head_dim
    return 2 * 2 * arch.num_layers * width * length * length / 2


def forward_flops(arch: Qwen3MoeArch, lengths: Iterable[int]) -> dict[str, float]:
    """One forward over sequences of `lengths` tokens (packed, each attending within itself):
    the decoder layers' (2 x their parameters a token + attention) and the output layer's."""
    lengths = list(lengths)
    params, tokens = gemm_params(arch), sum(lengths)
    return {"layers": 2 * params["layers"] * tokens + sum(attention_forward(arch, n) for n in lengths),
            "output": 2 * params["output"] * tokens}


def update_flops(config: Config, arch: Qwen3MoeArch, lengths: Iterable[int], forward_passes: int = 0) -> Flops:
    """A step's training FLOPs over sequences of `lengths`: train.ppo_epochs updates of 3 forwards
    (backward is twice the forward) and `forward_passes` forward-only passes of the batch."""
    forward = forward_flops(arch, lengths)
    once = forward["layers"] + forward["output"]
    epochs = config.train.ppo_epochs
    recomputed = (forward["layers"] if config.model.recompute == "full" else 0.0) + (
        forward["output"] if config.model.fused_logprobs else 0.0)  # the fused log-probs' logits again
    model = epochs * 3 * once
    return Flops(model=model, hardware=model + epochs * recomputed + forward_passes * once)


def utilization(flops: float, seconds: float, gpus: int, peak: float | None) -> float | None:
    """FLOPs per second per GPU over its peak: MFU from model FLOPs, HFU from hardware FLOPs;
    None where no peak is known (CPU, a GPU not in PEAK_BF16_FLOPS) or no time passed."""
    if peak is None or seconds <= 0:
        return None
    return flops / seconds / gpus / peak


def flops_by_kind(config: Config, arch: Qwen3MoeArch, lengths: Iterable[int], expert_share: float = 1.0,
                  last_stage: bool = True) -> dict[str, float]:
    """One training microbatch's hardware FLOPs on one trainer GPU by kind, for sequences of
    `lengths` (what gspo_mcore.rehearse counts op by op): forward, backward (2 x), and model.recompute
    full's second forward of the layers, model.fused_logprobs' second output GEMM; the layers of one
    pipeline stage (1 / PP of them); `dense` (attention's projections, the router, dense MLPs, the
    norms), `attention` and `output` split by TP; `experts` over this rank's 1/TP of the tokens
    (sequence parallel) and expert-TP, at `expert_share` times its own routed copies (an expert rank
    receiving more than its share computes more); the output layer on the last stage only."""
    lengths = list(lengths)
    d, tokens = config.distributed, sum(lengths)
    passes = 3 + (1 if config.model.recompute == "full" else 0)
    experts_per_token = sum(arch.moe_layers) * arch.num_experts_per_tok * 3 * arch.hidden_size * arch.moe_intermediate_size
    dense_per_token = gemm_params(arch)["layers"] - experts_per_token
    stage = d.tensor_parallel * d.pipeline_parallel
    return {"dense": 2 * dense_per_token * tokens * passes / stage,
            "experts": 2 * experts_per_token * tokens * passes * expert_share / (stage * d.expert_tensor_parallel),
            "attention": sum(attention_forward(arch, n) for n in lengths) * passes / stage,
            "output": 2 * gemm_params(arch)["output"] * tokens * (3 + (1 if config.model.fused_logprobs else 0))
            / d.tensor_parallel if last_stage else 0.0}
