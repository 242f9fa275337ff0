"""The check's sections, in the order a full run takes them. A section is a function of the
Check (gpucheck.context) returning its figures; what builds a model runs in a child process
(Check.child). Adding one: a module with its function, and a row here with its number and its
share of the 8-minute budget on one H100 (tests/test_gpu_check_parts.py holds the sum to it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from gpucheck import environment, host_adam, ipc_push, nccl_push, parity, resume, sync_check, throughput, updates

BUDGET_S = 500  # the whole check on one H100 with its wheel folder (a call may run 600 s)


@dataclass(frozen=True)
class Section:
    number: int
    name: str
    run: Callable  # (Check) -> figures
    estimate_s: int  # on one H100 (a first run: the synthetic checkpoint written once), child start-ups included


SECTIONS = (
    Section(1, "imports and environment", environment.section_1, 10),
    # transformers' model and two of ours (local in float32, torch in bf16) after the one-time checkpoint
    Section(2, "Qwen3-30B-A3B layer shapes: logits parity and HF export, spec local and torch", parity.section_2,
            80),
    Section(3, "GSPO updates at the 30B settings, one child per optimizer arm: memory against the planner",
            updates.section_3, 110),
    Section(4, "torch_dist save and resume, each in a process of its own", resume.section_4, 130),
    Section(5, "colocated CUDA-IPC push read by vLLM's packed_tensor", ipc_push.section_5, 15),
    Section(6, "NCCL push calls on a joining thread, closed and opened again", nccl_push.section_6, 15),
    Section(7, "weight-sync check against a stand-in engine", sync_check.section_7, 80),
    Section(8, "host Adam: Megatron's HybridDeviceOptimizer per parameter at 2 and 16 threads", host_adam.section_8,
            30),
    # One spawned child (~12 s of imports), ~4B parameters initialised on the device, 1 + 3 updates
    # of 16k tokens (< 1 s each at 10% MFU), one under torch.profiler (CUPTI's start, its tables).
    Section(9, "training throughput at the 30B widths, as many layers as fit beside GPU Adam: tokens/s, MFU, phases, "
               "top kernels", throughput.section_9, 30),
)
BY_NUMBER = {section.number: section for section in SECTIONS}
