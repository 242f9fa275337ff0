"""Section 8: what the CPU-offloaded optimizer (optimizer.cpu_offload) costs per parameter, measured
on Megatron's own HybridDeviceOptimizer (megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py)
built as megatron-core 0.16.1 builds it for the 30B config (optimizer/__init__.py,
_get_megatron_optimizer_based_on_param_groups: torch's AdamW fused on the host, offload fraction 1,
pinned copies, copies overlapped on streams of their own, fp32 master weights), on bf16 parameter
shards with fp32 gradients as the precision-aware distributed optimizer hands them over
(`decoupled_grad`, distrib_optimizer._copy_model_grads_to_main_grads). Nanoseconds per parameter for
each phase of HybridDeviceOptimizer.step apart: the gradients' device-to-host copy
(_set_sub_optimizer_grads), the host step at 2 and at 16 threads (torch.set_num_threads), the copy
back (its step post-hooks); and the whole step as it overlaps them.

One JSON line with `copy_to_host_ns_per_param`, `copy_back_ns_per_param`, `cpu_step_ns_per_param`
(keyed by thread count, a string) and `source`: what the planner's `--host-adam FILE.json` reads
(with `--out DIR` those four fields alone go to DIR/host_adam.json). On CPU (no streams, no pinned
memory) the host step alone, at a tiny size, with the optimizers Megatron's builder makes
(HybridDeviceOptimizer.build_cpu_optimizer_list); the copies are null."""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

THREADS = (2, 16)
REPEATS = 3
# (shards, parameters per shard): on CUDA 100.7M parameters (~1.8 GB of host memory) in shards of
# one expert projection at the 30B's widths, a typical optimizer shard's size; on CPU 64k.
SIZES = {"cuda": (64, 2048 * 768), "cpu": (4, 16384)}
# Adam as the 30B config sets it; `fused` is Megatron's ("improve the performance of the cpu
# optimizer"). The rate moves bf16 weights visibly, so the copy back can be checked.
ADAM = {"lr": 1e-3, "weight_decay": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "bias_correction": True, "fused": True}
FIELDS = ("copy_to_host_ns_per_param", "copy_back_ns_per_param", "cpu_step_ns_per_param", "source")


def section_8(check) -> dict:
    figures = check.child("gpucheck.host_adam:measure")
    if check.out_dir is not None and figures.get("pass") is True and figures.get("copy_to_host_ns_per_param"):
        figures["written"] = str(write_figures(check.out_dir / "host_adam.json", figures))
    return figures


def write_figures(path: Path, figures: dict) -> Path:
    """The fields the planner reads, alone, in `path` (temporary name, then renamed)."""
    partial = path.with_suffix(".part")
    # One line: the planner reads the file's lines (gspo_mcore.planner.host_adam.load_figures).
    partial.write_text(json.dumps({field: figures[field] for field in FIELDS}) + "\n")
    partial.rename(path)
    return path


def median_seconds(step, repeats: int = REPEATS) -> float:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        step()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def per_thread_count(step, threads) -> dict[str, float]:
    """Median seconds of `step` at each thread count (torch.set_num_threads; restored after)."""
    import torch

    kept, out = torch.get_num_threads(), {}
    try:
        for count in threads:
            torch.set_num_threads(count)
            out[str(count)] = median_seconds(step)
    finally:
        torch.set_num_threads(kept)
    return out


def source(device_name: str, params: int, shards: int) -> str:
    import torch

    import megatron.core

    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = "unknown CPU"
    return (f"launch/gpu_check.py section 8, {time.strftime('%Y-%m-%d')}: megatron-core "
            f"{getattr(megatron.core, '__version__', '?')} HybridDeviceOptimizer, {params / 1e6:.1f}M parameters in "
            f"{shards} shards, bf16 weights, fp32 gradients and master; {device_name}; host {cpu}, "
            f"{os.cpu_count()} cores; torch {torch.__version__}")


def measure(check, threads=THREADS) -> dict:
    """The child: the figures on this device (CUDA: the whole optimizer, and what they make of
    the 30B config's step; CPU: its host step)."""
    if check.device != "cuda":
        return cpu_figures(threads)
    figures = cuda_figures(threads)
    figures["at_30b_ep8"] = at_30b_ep8(figures)
    return figures


def at_30b_ep8(figures: dict) -> dict:
    """The measured figures through the planner's model of the offload
    (gspo_mcore.planner.host_adam.HostAdamFigures: the three phases summed, an upper bound) for
    configs/qwen3_30b_a3b_gspo.yaml on one node of 8 GPUs (EP8; the distributed optimizer's shard
    a GPU steps, gspo_mcore.planner.memory_model.optimizer_params_per_gpu): seconds per optimizer
    step and per training step (its minibatches x epochs) at each measured thread count."""
    from checkpoint_convert.synthetic import QWEN3_30B_A3B
    from gpucheck.shape import REPO
    from gspo_mcore.config import load_config
    from gspo_mcore.megatron.qwen3_moe.hf_config import parse_hf_config
    from gspo_mcore.planner.host_adam import HostAdamFigures
    from gspo_mcore.planner.memory_model import check_layout, optimizer_params_per_gpu

    config, arch = load_config(REPO / "configs/qwen3_30b_a3b_gspo.yaml"), parse_hf_config(QWEN3_30B_A3B)
    params = optimizer_params_per_gpu(config, arch, check_layout(config, arch, 1, 8))
    measured = HostAdamFigures(figures["copy_to_host_ns_per_param"], figures["copy_back_ns_per_param"],
                               {int(k): v for k, v in figures["cpu_step_ns_per_param"].items()}, figures["source"])
    steps = config.train.num_minibatches * config.train.ppo_epochs
    out = {"params_per_gpu_b": params / 1e9, "optimizer_steps_per_training_step": steps}
    for threads in sorted(measured.cpu_step_ns_per_param):
        out[f"optimizer_step_s_at_{threads}_threads"] = measured.step_seconds(params, threads)
        out[f"training_step_s_at_{threads}_threads"] = measured.step_seconds(params, threads) * steps
    return out


def ns_per_param(seconds, params: int):
    if isinstance(seconds, dict):
        return {key: value / params * 1e9 for key, value in seconds.items()}
    return seconds / params * 1e9


def cpu_figures(threads) -> dict:
    import torch
    from torch.optim import AdamW

    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    count, size = SIZES["cpu"]
    shards = [torch.randn(size) * 0.02 for _ in range(count)]
    for shard in shards:
        shard.grad = torch.randn(size)
    start = shards[0].clone()
    optimizers = HybridDeviceOptimizer.build_cpu_optimizer_list(AdamW, [{"params": shards, **ADAM}])
    for optimizer in optimizers:  # the first step makes Adam's states
        optimizer.step()
    params = size * count
    step = per_thread_count(lambda: [optimizer.step() for optimizer in optimizers], threads)
    figures = {"params": params, "shards": len(shards), "copy_to_host_ns_per_param": None,
               "copy_back_ns_per_param": None, "cpu_step_ns_per_param": ns_per_param(step, params),
               "source": source("no GPU (the host step alone)", params, len(shards)),
               "moved": not torch.equal(start, shards[0])}
    figures["pass"] = figures["moved"] and all(v > 0 for v in figures["cpu_step_ns_per_param"].values())
    return figures


def copy_to_host(optimizer) -> None:
    """HybridDeviceOptimizer.step's first phase: the fp32 gradients into the pinned host copies on
    its device-to-host stream (_set_sub_optimizer_grads), waited for."""
    import torch

    optimizer._d2h_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(optimizer._d2h_stream):
        optimizer._set_sub_optimizer_grads()
    torch.cuda.synchronize()
    optimizer._cpu_optimizer_map_data_event.clear()


def host_step(optimizer) -> None:
    """The host Adam step of every per-shard optimizer without its post-hook (the copy back,
    registered by _register_param_copy_back_gpu_hook), which copy_back times apart."""
    for inner in optimizer.cpu_optimizers:
        hooks = dict(inner._optimizer_step_post_hooks)  # torch.optim.Optimizer's hook table
        inner._optimizer_step_post_hooks.clear()
        try:
            inner.step()
        finally:
            inner._optimizer_step_post_hooks.update(hooks)


def copy_back(optimizer) -> None:
    """The post-hooks alone: each shard's fp32 master into its bf16 weight on the host-to-device
    stream, waited for."""
    import torch

    for inner in optimizer.cpu_optimizers:
        for hook in inner._optimizer_step_post_hooks.values():
            hook(inner, (), {})
    torch.cuda.synchronize()


def whole_step(optimizer) -> None:
    import torch

    optimizer.step()
    torch.cuda.synchronize()


def cuda_optimizer(shards: int, size: int):
    """bf16 weight shards (views of one flat buffer, as the distributed optimizer's) with fp32
    gradient views beside them, and the HybridDeviceOptimizer over them."""
    import torch
    from torch.optim import AdamW

    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    weights = (torch.randn(size * shards, device="cuda") * 0.02).to(torch.bfloat16)
    grads = torch.randn(size * shards, device="cuda")
    views = [weights[i * size:(i + 1) * size] for i in range(shards)]
    for i, view in enumerate(views):
        view.decoupled_grad = grads[i * size:(i + 1) * size]
    optimizer = HybridDeviceOptimizer([{"params": views}], offload_fraction=1.0, cpu_optimizer_cls=AdamW,
                                      gpu_optimizer_cls=AdamW, overlap_cpu_optimizer_d2h_h2d=True, pin_cpu_grads=True,
                                      pin_cpu_params=True, param_update_in_fp32=True, **ADAM)
    return optimizer, views


def cuda_figures(threads) -> dict:
    import torch

    optimizer, views = cuda_optimizer(*SIZES["cuda"])
    start = views[0].clone()
    whole_step(optimizer)  # the first step makes Adam's states and the pinned gradient copies
    params = sum(view.numel() for view in views)
    to_host = median_seconds(lambda: copy_to_host(optimizer))
    step = per_thread_count(lambda: host_step(optimizer), threads)
    back = median_seconds(lambda: copy_back(optimizer))
    whole = per_thread_count(lambda: whole_step(optimizer), threads)
    master = optimizer.gpu_params_map_cpu_copy[views[0]]  # the host's fp32 master of the first shard
    figures = {"params": params, "shards": len(views), "copy_to_host_ns_per_param": ns_per_param(to_host, params),
               "copy_back_ns_per_param": ns_per_param(back, params),
               "cpu_step_ns_per_param": ns_per_param(step, params),
               "whole_step_ns_per_param": ns_per_param(whole, params),
               "source": source(torch.cuda.get_device_name(), params, len(views)),
               "moved": not torch.equal(start, views[0]),
               "copy_back_exact": torch.equal(views[0], master.to(torch.bfloat16).to(views[0].device))}
    figures["pass"] = figures["moved"] and figures["copy_back_exact"] and all(
        v > 0 for v in [figures["copy_to_host_ns_per_param"], figures["copy_back_ns_per_param"],
                        *figures["cpu_step_ns_per_param"].values()])
    return figures
