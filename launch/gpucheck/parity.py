"""Section 2: Qwen3-30B-A3B's layer shapes (128 experts top-8, hidden 2048, 32/4 heads of 128,
expert FFN 768, vocabulary 151,936) at 2 layers, `spec: local`, from a synthetic checkpoint
(~3.7 GB, written once into WORK): float32 logits against `transformers`
(gspo_mcore.megatron.parity.run) and the HF export bitwise the checkpoint's. In a child: the two
models' memory leaves with it."""

from __future__ import annotations


def section_2(check) -> dict:
    return check.child("gpucheck.parity:parity")


def parity(check) -> dict:
    import torch

    from gpucheck.shape import check_config, make_inputs
    from gspo_mcore.megatron.parity import run, sample_tokens

    shape = check.shape
    hf_dir = make_inputs(check.work, shape)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # float32 means float32
    config = check_config(check.work, shape, hf_dir, "float32")
    tokens = sample_tokens(shape.hf["vocab_size"], shape.parity_batch, shape.parity_len)
    figures = run(config, tokens)
    # float32 on both sides: rounding-level differences (a router near-tie may flip one expert).
    figures["pass"] = (figures["export_bitwise_identical"] and figures["top1_agreement"] >= 0.99
                       and figures["mean_abs_logit_diff"] <= 1e-3 * max(figures["logit_std"], 1e-6))
    return figures
