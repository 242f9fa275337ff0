"""The time an offloaded optimizer (optimizer.cpu_offload) keeps the GPUs waiting: megatron-core
0.16.1's HybridDeviceOptimizer (optimizer/cpu_offloading/hybrid_optimizer.py, `step`) copies each
parameter's fp32 gradient shard to pinned host memory (`_set_sub_optimizer_grads`), steps
torch.optim.AdamW(fused=True) on the host, one optimizer per parameter
(`build_cpu_optimizer_list`), and copies the updated weight back (`param_copy_back_gpu_hook`).
Per optimizer step:

    seconds = params_per_gpu x (copy_to_host_ns + cpu_step_ns(threads) + copy_back_ns) / 1e9

the three summed (Megatron's overlap_cpu_optimizer_d2h_h2d overlaps one parameter's copies with
another's step, so this is an upper bound), at the host threads a trainer rank gets
(gspo_mcore.run.torchrun sets OMP_NUM_THREADS to the node's cores over its ranks).

The figures live in one HostAdamFigures; `launch/gpu_check.py`'s host-Adam section prints a JSON
line with its field names, measured on the GPU machine, which `python -m gspo_mcore.planner.cli
--host-adam FILE` takes in place of the built-in ones. `python -m gspo_mcore.planner.host_adam`
measures the CPU step on this machine.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from gspo_mcore.config import ConfigError

# Pinned host <-> H100 copies over PCIe Gen5 x16: ~25 GB/s a direction with 8 GPUs of a node
# copying at once (half the link's ~50). An estimate, not a measurement.
PCIE_PINNED_GB_S = 25.0
# Bytes a parameter crosses each way: its fp32 gradient to the host, its fp32 updated weight back
# (copied into the GPU's bf16 shard: the cast happens on the GPU).
COPY_BYTES = 4
# The GPUs idle while the host steps; beyond this share of the update's own time the plan says so.
OFFLOAD_WARN_FRACTION = 0.25
# The update's share of an H100's bf16 peak assumed for its time from the FLOPs (a stated
# assumption: Megatron's MoE recipes report 20-35% on H100 with Transformer Engine).
ASSUMED_UPDATE_MFU = 0.25


@dataclass(frozen=True)
class HostAdamFigures:
    """ns per parameter of each part of an offloaded optimizer step: the device-to-host copy, the
    CPU step at a number of host threads (the keys), the copy back; `source` says where they come
    from. The field names are the JSON line's."""
    copy_to_host_ns_per_param: float
    copy_back_ns_per_param: float
    cpu_step_ns_per_param: dict[int, float]
    source: str

    def cpu_step_ns(self, threads: int) -> float:
        """The CPU step at `threads`: a measured figure, else interpolated on log-log between the
        two measured around it; below the fewest measured, slower in proportion (the step splits
        over threads); above the most, no faster (it is then bound by the host's memory bandwidth)."""
        measured = sorted(self.cpu_step_ns_per_param.items())
        if threads in self.cpu_step_ns_per_param:
            return self.cpu_step_ns_per_param[threads]
        (fewest, slowest), (most, fastest) = measured[0], measured[-1]
        if threads < fewest:
            return slowest * fewest / threads
        if threads > most:
            return fastest
        (low, at_low), (high, at_high) = next((a, b) for a, b in zip(measured, measured[1:]) if a[0] < threads < b[0])
        slope = math.log(at_high / at_low) / math.log(high / low)
        return at_low * (threads / low) ** slope

    def ns_per_param(self, threads: int) -> float:
        return self.copy_to_host_ns_per_param + self.cpu_step_ns(threads) + self.copy_back_ns_per_param

    def step_seconds(self, params: float, threads: int) -> float:
        """One optimizer step over `params` parameters at `threads` host threads."""
        return params * self.ns_per_param(threads) / 1e9


_COPY_NS = COPY_BYTES / PCIE_PINNED_GB_S
# A GPU's share of its node's host memory bandwidth when all 8 step at once: a DGX H100's two
# 8-channel DDR5-4800 sockets (614 GB/s peak, ~450 streamed) over 8 GPUs. Adam's fp32 step streams
# 28 bytes a parameter (weight, gradient, two moments read; weight and moments written), so no
# thread count steps a parameter faster than 28 / 56 = 0.5 ns. An estimate, not a measurement.
HOST_MEMORY_GB_S_PER_GPU = 56.0
ADAM_BYTES_PER_PARAM = 28
# The CPU step measured on this project's 2-core AMD EPYC machine (torch 2.13's AdamW(fused=True),
# fp32, 8 tensors of 2^22 parameters, an optimizer each as HybridDeviceOptimizer builds them:
# `python -m gspo_mcore.planner.host_adam`, the fastest of 28 steps, the best of ~25 runs on a
# machine shared with other work: 0.66 ns at 1 thread, 0.51 at 2). 16 threads extrapolated, not
# measured: the 2-thread figure split 8 ways, but no faster than the memory bound above.
_MEASURED = {1: 0.66, 2: 0.51}
BUILT_IN = HostAdamFigures(
    copy_to_host_ns_per_param=_COPY_NS, copy_back_ns_per_param=_COPY_NS,
    cpu_step_ns_per_param={**_MEASURED, 16: max(_MEASURED[2] * 2 / 16, ADAM_BYTES_PER_PARAM / HOST_MEMORY_GB_S_PER_GPU)},
    source="built-in: CPU step measured at 1 and 2 threads on a 2-core EPYC, 16 threads extrapolated (memory-bound); "
           f"copies estimated at {PCIE_PINNED_GB_S:g} GB/s pinned PCIe")
FIELDS = ("copy_to_host_ns_per_param", "copy_back_ns_per_param", "cpu_step_ns_per_param")


def load_figures(path: str | Path) -> HostAdamFigures:
    """Figures from a measured JSON line (launch/gpu_check.py's host-Adam section): the file's last
    line that is a JSON object with every field of HostAdamFigures (others ignored, so the check's
    whole --out file serves). One-line ConfigError naming the file and the field otherwise."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as err:
        raise ConfigError(f"--host-adam {path}: {err.strerror or err}") from None
    found = None
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and any(field in record for field in FIELDS):
            found = record
    if found is None:
        raise ConfigError(f"--host-adam {path}: no JSON line with {', '.join(FIELDS)}")
    missing = [field for field in FIELDS if field not in found]
    if missing:
        raise ConfigError(f"--host-adam {path}: its line lacks {', '.join(missing)}")
    for field in FIELDS[:2]:
        if not _positive(found[field]):
            raise ConfigError(f"--host-adam {path}: {field} {found[field]!r} is not a positive number")
    steps = found["cpu_step_ns_per_param"]
    if not isinstance(steps, dict) or not steps:
        raise ConfigError(f"--host-adam {path}: cpu_step_ns_per_param must map threads to ns, got {steps!r}")
    by_threads = {}
    for threads, ns in steps.items():
        if not (str(threads).isdigit() and int(threads) > 0 and _positive(ns)):
            raise ConfigError(f"--host-adam {path}: cpu_step_ns_per_param[{threads!r}] = {ns!r}: threads must be a "
                              "positive integer and ns a positive number")
        by_threads[int(threads)] = float(ns)
    return HostAdamFigures(float(found["copy_to_host_ns_per_param"]), float(found["copy_back_ns_per_param"]),
                           by_threads, str(found.get("source") or f"measured: {path}"))


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def host_adam_estimate(params_per_gpu: float, optimizer_steps: int, threads: int, update_seconds: float,
                       figures: HostAdamFigures = BUILT_IN) -> dict:
    """An offloaded optimizer's host time: per optimizer step and per training step
    (`optimizer_steps` of them: minibatches x epochs), against the update's own GPU time."""
    step = figures.step_seconds(params_per_gpu, threads)
    per_training_step = step * optimizer_steps
    return {"host_adam_threads": threads, "host_adam_ns_per_param": figures.ns_per_param(threads),
            "host_adam_cpu_step_ns_per_param": figures.cpu_step_ns(threads),
            "host_adam_params_per_gpu": params_per_gpu, "host_adam_optimizer_step_s": step,
            "host_adam_optimizer_steps": optimizer_steps, "host_adam_training_step_s": per_training_step,
            "update_compute_s": update_seconds, "host_adam_fraction": per_training_step / update_seconds,
            "host_adam_source": figures.source}


def measure_cpu_step_ns(threads: int, params: int = 2**25, tensors: int = 8, steps: int = 30) -> float:
    """ns per parameter of torch.optim.AdamW(fused=True) on the host in fp32, one optimizer per
    tensor as HybridDeviceOptimizer builds them (build_cpu_optimizer_list), at `threads`
    intra-op threads: the fastest of `steps` steps (the first two warm up)."""
    import time

    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        weights = [torch.nn.Parameter(torch.randn(params // tensors, device="cpu")) for _ in range(tensors)]
        for weight in weights:
            weight.grad = torch.randn_like(weight) * 1e-3
        optimizers = [torch.optim.AdamW([w], lr=1e-6, weight_decay=0.01, fused=True) for w in weights]
        times = []
        for _ in range(steps):
            began = time.perf_counter()
            for optimizer in optimizers:
                optimizer.step()
            times.append(time.perf_counter() - began)
        return min(times[2:]) / (params // tensors * tensors) * 1e9
    finally:
        torch.set_num_threads(before)


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m gspo_mcore.planner.host_adam",
                                     description="Measure the offloaded Adam's CPU step here; print a --host-adam line.")
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    parser.add_argument("--params", type=int, default=2**25)
    args = parser.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
    measured = {t: measure_cpu_step_ns(t, args.params) for t in threads}
    print(json.dumps({"copy_to_host_ns_per_param": BUILT_IN.copy_to_host_ns_per_param,
                      "copy_back_ns_per_param": BUILT_IN.copy_back_ns_per_param, "cpu_step_ns_per_param": measured,
                      "source": f"CPU step measured here at {args.threads} threads; copies estimated at "
                                f"{PCIE_PINNED_GB_S:g} GB/s pinned PCIe"}), flush=True)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
