"""The check's sections and the order a full run takes them in. A section is a function of the
Check (gpucheck.context) returning its figures; what builds a model runs in a child process
(Check.child). Adding one: a module with its function, a row here with its number and its
estimate on one H100, and its place in ORDER (tests/test_gpu_check_parts.py holds ORDER to the
sections and --budget to the estimates)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from gpucheck import (environment, host_adam, ipc_push, nccl_push, parity, resume, step_memory, sync_check, throughput,
                      updates)


@dataclass(frozen=True)
class Section:
    number: int
    name: str
    run: Callable  # (Check) -> figures
    estimate_s: int  # on one H100 (a first run: the synthetic checkpoint written once), child start-ups included


SECTIONS = (
    Section(1, "imports and environment", environment.section_1, 10),
    # transformers' model and two of ours (local in float32, torch in bf16) after the one-time checkpoint
    Section(2, "Qwen3-30B-A3B layer shapes: logits parity and HF export, spec local and torch; the empty-expert "
                "gradient probe", parity.section_2,
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
    # The measured child (imports, the 2-layer learner from the synthetic checkpoint, 3 updates of
    # 16k tokens, one bucket, one forward) beside the rehearsal's two processes (~45 s on the host).
    Section(10, "the rehearsed step measured: each phase's peak against the rehearsal's and the planner's",
            step_memory.section_10, 50),
)
BY_NUMBER = {section.number: section for section in SECTIONS}
# A full run's order: what decides most about a first device first, as a device is often had for
# minutes (one call at most 600 s): the environment, the NCCL push calls, parity (the grouped GEMM
# path), throughput, memory (the optimizer arms, the rehearsed step), then the rest.
ORDER = (1, 6, 2, 9, 3, 10, 5, 7, 8, 4)
