"""Section 3: GSPO updates in bf16 at the 30B config's settings (its recompute and loss; the
check's 16k-token microbatch at 2 layers of the real widths on CUDA), one child process per
optimizer arm, the second update timed. Each arm is a line of its own as soon as it is measured:
finite loss and gradient norm, weights moved, tokens/s, MFU and HFU (model and hardware
FLOPs: gspo_mcore.planner.flops), and the memory: allocated before
the learner was built (baseline), the peak, and peak minus baseline against the planner's
estimate for the same shape (gspo_mcore.planner.memory_model.memory_estimate), within
ESTIMATE_TOLERANCE.

Arms: `offload` (the config's optimizer: Megatron's HybridDeviceOptimizer, CUDA only),
`device_adam` (optimizer.cpu_offload=false: Adam's states on the device), `precision_aware`
(Megatron's precision-aware optimizer on Transformer Engine's FusedAdam: skipped before anything
is built where TE is not importable, as on a bare machine, or without CUDA)."""

from __future__ import annotations

import importlib.util
import math

PRECISION_AWARE = ("optimizer.cpu_offload=false", "optimizer.precision_aware=true")
ARMS = {"offload": (), "device_adam": ("optimizer.cpu_offload=false",), "precision_aware": PRECISION_AWARE}


def transformer_engine_importable() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def arm_skip(arm: str, device: str) -> str | None:
    """Why `arm` cannot run here (None: it can), decided before any child or model is built."""
    if arm == "offload" and device != "cuda":
        return "optimizer.cpu_offload: Megatron's HybridDeviceOptimizer is CUDA only"
    if arm == "precision_aware":
        if device != "cuda":
            return "optimizer.precision_aware: needs CUDA (Transformer Engine's FusedAdam)"
        if not transformer_engine_importable():
            return "optimizer.precision_aware: Transformer Engine is not importable here (its FusedAdam runs the arm)"
    return None


def section_3(check) -> dict:
    lines = {}
    for arm, extra in ARMS.items():
        skip = arm_skip(arm, check.device)
        figures = {"skip": skip} if skip else check.child("gpucheck.updates:arm", extra=list(extra))
        lines[arm] = check.part(3, arm, figures)
    return summary(lines)


def summary(lines: dict[str, dict]) -> dict:
    """The section's line from its arms' lines: each arm's result, step time and memory ratio side
    by side; PASS when an arm ran and none failed."""
    ran = {arm: line for arm, line in lines.items() if line["result"] != "SKIP"}
    figures = {"arms": {arm: line["result"] for arm, line in lines.items()},
               **{f"{key}_by_arm": {arm: line.get(key) for arm, line in ran.items()}
                  for key in ("update_s", "peak_minus_baseline_gb", "planned_gb", "peak_over_planned")}}
    if "offload" in ran and "device_adam" in ran and ran["device_adam"].get("update_s"):
        figures["offload_update_s_over_device_adam"] = ran["offload"]["update_s"] / ran["device_adam"]["update_s"]
    figures["pass"] = bool(ran) and all(line["result"] == "PASS" for line in ran.values())
    return figures


def memory_figures(planned: dict, tolerance: float, baseline: int | None, peak: int | None) -> dict:
    """The planner's estimate beside what was allocated: baseline (before the learner was built),
    peak, peak minus baseline (what the learner took) and its ratio to the estimate; "within":
    the ratio <= tolerance. Without allocator figures (CPU) the estimate alone."""
    gb = 2**30
    figures = {"planned_gb": planned["trainer_total_gb"], "planned_optimizer_gb": planned.get("trainer_optimizer_gb"),
               "tolerance": tolerance}
    if peak is not None:
        used = (peak - baseline) / gb
        figures.update(baseline_gb=baseline / gb, peak_gb=peak / gb, peak_minus_baseline_gb=used,
                       peak_over_planned=used / planned["trainer_total_gb"])
        figures["within"] = figures["peak_over_planned"] <= tolerance
    return figures


def arm(check, extra=()) -> dict:
    """The child of one arm: a learner of the check's config (+ `extra` overrides) and two
    updates, the second timed (the first allocates the optimizer's states and warms the kernels)."""
    import torch

    from gpucheck.shape import check_config, make_inputs, param_digest, update_once
    from gspo_mcore.megatron.learner import Learner
    from gspo_mcore.megatron.qwen3_moe.hf_config import parse_hf_config
    from gspo_mcore.planner.flops import peak_flops, update_flops, utilization
    from gspo_mcore.planner.memory_model import ESTIMATE_TOLERANCE, check_layout, memory_estimate, param_counts

    shape, cuda = check.shape, check.device == "cuda"
    config = check_config(check.work, shape, make_inputs(check.work, shape), "bfloat16", extra)
    arch = parse_hf_config(shape.hf)
    if cuda:
        torch.cuda.init()
        torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated() if cuda else None
    learner = Learner(config)
    before = param_digest(learner.model)
    update_once(learner, shape, step=1)
    report, seconds = update_once(learner, shape, step=2)
    peak = torch.cuda.max_memory_allocated() if cuda else None
    moved = sum(a != b for a, b in zip(before.values(), param_digest(learner.model).values()))
    figures = {"overrides": list(extra), "loss": report.get("loss"), "grad_norm": report.get("grad_norm"),
               "params_moved": moved, "params": len(before), "update_s": seconds,
               "train_tokens_per_s": shape.tokens / seconds, "active_params_b": param_counts(arch)["active"] / 1e9}
    # The update's FLOPs as the planner counts them: MFU from the model count (6N + attention a
    # token, the published figures'), HFU from the hardware count (+ the recomputed forwards).
    flops = update_flops(config, arch, shape.lengths)
    # The dense bf16 FLOP/s (None: CPU, or a GPU not in the table); `peak` is the memory's
    device_flops = peak_flops(torch.cuda.get_device_name()) if cuda else None
    figures.update(peak_tflops=device_flops / 1e12 if device_flops else None,
                   mfu=utilization(flops.model, seconds, 1, device_flops),
                   hfu=utilization(flops.hardware, seconds, 1, device_flops))
    planned = memory_estimate(config, arch, check_layout(config, arch, 1, 1), shape.prompt)
    figures.update(memory_figures(planned, ESTIMATE_TOLERANCE, baseline, peak))
    finite = all(isinstance(figures[k], float) and math.isfinite(figures[k]) for k in ("loss", "grad_norm"))
    figures["pass"] = finite and figures["grad_norm"] > 0 and moved > 0 and figures.get("within", True)
    return figures
