"""The one-GPU check to run first, on any CUDA machine with PyTorch, before building the image:

    python launch/gpu_check.py [--wheels DIR] [--work DIR] [--only N ...] [--device cuda|cpu] [--out DIR]

It needs only Python 3.11 or 3.12, a CUDA PyTorch >= 2.11, `transformers` >= 5.17, this
repository and the wheel folder `launch/wheelhouse.sh DIR` fills (megatron-core 0.16.1 and the
few packages the trainer imports besides torch and transformers, plus vLLM 0.33's
`packed_tensor.py`): they go on sys.path here, without pip. Offline.

Each section prints one JSON line {"section": N, "name": ..., "result": "PASS" | "FAIL" | "SKIP",
figures...} (section 3 one more per optimizer arm, as each is measured); `--out DIR` appends them
to DIR/gpu_check.jsonl as they are made. The exit status is 1 when any failed. `--device cpu` (the
default without CUDA) runs every section that can run on CPU at a tiny shape
(tests/test_gpu_check.py). The sections are the package beside this file, `launch/gpucheck/`
(registry.py lists them, each a function that runs on CPU at a tiny shape); every learner is built
in a child process of its own:

1. imports and environment; 2. logits parity with transformers and the HF export at the 30B layer
shapes; 3. GSPO updates, one child per optimizer arm, memory against the planner; 4. torch_dist save
and resume; 5. the CUDA-IPC push read by vLLM's packed_tensor; 6. the NCCL push calls; 7. the sync
check against a stand-in engine; 8. host Adam (HybridDeviceOptimizer) per parameter; 9. training
throughput at the 30B widths with as many layers as fit beside GPU Adam (`spec: torch`, fused
log-probs, a 16k-token microbatch): tokens/s, MFU against 30%, the peak against the planner, each
phase's time and the top kernels; 10. the rehearsed step measured: each phase's peak (training, the
weight push, the sync check) beside `python -m gspo_mcore.rehearse`'s and the planner's.
"""

import sys

from gpucheck.main import main

if __name__ == "__main__":
    sys.exit(main())
