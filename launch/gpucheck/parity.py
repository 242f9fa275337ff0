"""Section 2: Qwen3-30B-A3B's layer shapes (128 experts top-8, hidden 2048, 32/4 heads of 128,
expert FFN 768, vocabulary 151,936) at 2 layers, from a synthetic checkpoint (~3.7 GB, written
once into WORK): float32 logits against `transformers` (gspo_mcore.megatron.parity.run) and the
HF export bitwise the checkpoint's, for `spec: local` in float32 and `spec: torch` in bfloat16
(torch._grouped_mm on sm90/sm100: the path CPU never runs) against the same float32 reference,
computed once; and on CUDA the zero-size-group probe of `_grouped_mm`'s weight gradient
(pytorch#172439: not zero on sm100), raw and through the trainer's mask. In a child: the models'
memory leaves with it."""

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
    if check.device == "cuda":
        figures["empty_expert_grad"] = empty_group_probe()
        figures["pass"] = figures["pass"] and figures["empty_expert_grad"]["pass"]
    return figures


def empty_group_probe(experts: int = 8, hidden: int = 2048, ffn: int = 1536, device: str = "cuda",
                      dtype_name: str = "bfloat16") -> dict:
    """torch._grouped_mm's weight gradient for experts that got no tokens, in bf16 at the 30B
    widths: raw (zero on Hopper; pytorch#172439 reports garbage on sm100) and through
    experts.grouped_matmul (which masks it where the rule says: ZeroEmptyExpertGrads). PASS when
    the trainer's is zero; the raw figure says whether the rule's device needs the mask."""
    import torch

    from gspo_mcore.megatron.qwen3_moe import experts as grouped

    torch.manual_seed(0)
    dtype = getattr(torch, dtype_name)
    counts = torch.tensor([64, 0, 32, 0, 0, 16, 8, 0], device=device)[:experts]
    x = torch.randn(int(counts.sum()), hidden, device=device, dtype=dtype)
    weight = torch.randn(experts, ffn, hidden, device=device, dtype=dtype, requires_grad=True)
    offsets = grouped.expert_offsets(counts, x.device)
    empty = (counts == 0).nonzero().flatten()
    raw = torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
    raw.float().square().sum().backward()
    raw_max = float(weight.grad[empty].abs().max())
    weight.grad = None
    ours = grouped.grouped_matmul(x, weight, offsets)
    ours.float().square().sum().backward()
    ours_max = float(weight.grad[empty].abs().max())
    capability = torch.cuda.get_device_capability() if device == "cuda" else None
    return {"capability": f"sm{capability[0]}{capability[1]}" if capability else device,
            "masked_here": bool(capability and grouped.zeroes_empty_expert_grads(capability)),
            "raw_max_abs": raw_max, "trainer_max_abs": ours_max, "pass": ours_max == 0.0}


def _float32_pass(figures: dict) -> bool:
    """float32 on both sides: rounding-level differences (a router near-tie may flip one expert)."""
    return (figures["export_bitwise_identical"] and figures["top1_agreement"] >= 0.99
            and figures["mean_abs_logit_diff"] <= 1e-3 * max(figures["logit_std"], 1e-6))
