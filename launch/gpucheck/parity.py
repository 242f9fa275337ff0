"""Section 2: Qwen3-30B-A3B's layer shapes (128 experts top-8, hidden 2048, 32/4 heads of 128,
expert FFN 768, vocabulary 151,936) at 2 layers, from a synthetic checkpoint (~3.7 GB, written
once into WORK): float32 logits against `transformers` (gspo_mcore.megatron.parity.run) and the
HF export bitwise the checkpoint's, for `spec: local` in float32 and `spec: torch` in bfloat16
(torch._grouped_mm on sm90/sm100: the path CPU never runs) against the same float32 reference,
computed once. In a child: the models' memory leaves with it."""

from __future__ import annotations


def section_2(check) -> dict:
    return check.child("gpucheck.parity:parity")


def parity(check) -> dict:
    import torch

    from gpucheck.shape import check_config, make_inputs
    from gspo_mcore.megatron.parity import hf_logits, run, sample_tokens

    shape = check.shape
    hf_dir = make_inputs(check.work, shape)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # float32 means float32
    config = check_config(check.work, shape, hf_dir, "float32")
    tokens = sample_tokens(shape.hf["vocab_size"], shape.parity_batch, shape.parity_len)
    reference = hf_logits(hf_dir, tokens)  # transformers in float32, for both arms
    figures = run(config, tokens, reference=reference)
    figures["pass"] = _float32_pass(figures)
    # spec torch in bf16: torch._grouped_mm on sm90/sm100 (its float32 experts, the per-expert
    # loop, are CPU's parity test). Against the same float32 reference: bf16 rounding (a router
    # near-tie flips an expert now and then) stays far below a wrong expert mapping's ~1 x std.
    grouped = run(check_config(check.work, shape, hf_dir, "bfloat16", ["model.spec=torch"]), tokens,
                  reference=reference)
    figures["bf16_torch_spec"] = {**grouped, "pass": bool(
        grouped["export_bitwise_identical"] and grouped["top1_agreement"] >= 0.9
        and grouped["mean_abs_logit_diff"] <= 0.1 * max(grouped["logit_std"], 1e-6))}
    figures["pass"] = figures["pass"] and figures["bf16_torch_spec"]["pass"]
    return figures


def _float32_pass(figures: dict) -> bool:
    """float32 on both sides: rounding-level differences (a router near-tie may flip one expert)."""
    return (figures["export_bitwise_identical"] and figures["top1_agreement"] >= 0.99
            and figures["mean_abs_logit_diff"] <= 1e-3 * max(figures["logit_std"], 1e-6))
