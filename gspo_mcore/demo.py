"""`make demo`: the embedded CPU default.

Until the GSPO trainer lands, the demo proves the model layer: it writes a random tiny
Qwen3-MoE in Hugging Face format, loads it into the real Megatron-Core model through the
mapping table under several parallel layouts (2 ranks, gloo), and prints the logits
parity against transformers for each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

LAYOUTS = [
    ("single process", 1, []),
    ("expert parallel 2", 2, ["distributed.expert_parallel=2"]),
    ("pipeline parallel 2", 2, ["distributed.pipeline_parallel=2"]),
    ("tensor parallel 2 + sequence parallel", 2, ["distributed.tensor_parallel=2"]),
    ("data parallel 2", 2, []),
]


CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny_cpu.yaml"


def main() -> int:
    from gspo_mcore.config import load_config

    hf_dir = Path(load_config(CONFIG).model.hf_dir)
    if not (hf_dir / "config.json").is_file():
        from gspo_mcore.models.qwen3_moe.tiny import make_tiny_checkpoint

        print(f"writing a random tiny Qwen3-MoE to {hf_dir}", flush=True)
        make_tiny_checkpoint(hf_dir, seed=0)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    print(f"{'layout':40s} {'max |dlogit|':>13s} {'mean |dlogit|':>14s} {'top-1 agree':>12s} {'time':>6s}")
    worst = 0.0
    for label, nproc, overrides in LAYOUTS:
        launcher = [sys.executable] if nproc == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
        cmd = [*launcher, "-m", "gspo_mcore.parity", "--config", str(CONFIG), *overrides]
        start = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            print(proc.stderr[-4000:], file=sys.stderr)
            print(f"demo: {label} failed (exit {proc.returncode}): {' '.join(cmd)}", file=sys.stderr)
            return 1
        figures = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
        worst = max(worst, figures["max_abs_logit_diff"])
        print(
            f"{label:40s} {figures['max_abs_logit_diff']:13.2e} {figures['mean_abs_logit_diff']:14.2e} "
            f"{figures['top1_agreement']:12.3f} {time.time() - start:5.1f}s",
            flush=True,
        )
        if not figures["export_bitwise_identical"]:
            print(f"demo: {label}: weights exported from the sharded model differ from the checkpoint",
                  file=sys.stderr)
            return 1
    print(f"worst max |logit difference| vs transformers: {worst:.2e} (float32; tests require <= 1e-4); "
          "weights exported back from every layout are bitwise the checkpoint's")
    return 0 if worst <= 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
