"""docs/08-gpu.md's rehearsal table: every GPU config's whole model rehearsed on CPU
(`python -m gspo_mcore.rehearse`, one process a config, its roles inside), one markdown row per
config and rank role: peak GiB per phase, the planner's, their ratio, the FLOPs of a full
microbatch's step beside the planner's, and where the host waits on the device (GPU syncs) in that
step: this project's lines and megatron-core's.

    python bench/rehearse_table.py [--layers N] [--only CONFIG ...] [--from-dir DIR]

`--from-dir DIR` reads `DIR/<config stem>.out` (the command's stdout) instead of running it. Takes
~2 minutes a 30B config on 2 cores, ~10 for the 235B one (96 ranks, two roles).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HF = {"30b": "configs/hf/qwen3-30b-a3b.config.json", "235b": "configs/hf/qwen3-235b-a22b.config.json"}
# Every GPU config and its node count (tests/helpers.py GPU_CONFIGS holds the same).
CONFIGS = {"qwen3_30b_a3b_gspo": 1, "qwen3_30b_a3b_gspo_2node": 2, "qwen3_30b_a3b_gspo_async": 2,
           "qwen3_30b_a3b_gspo_async_1node": 1, "qwen3_30b_a3b_gspo_tools": 1, "qwen3_30b_a3b_gspo_code": 1,
           "qwen3_30b_a3b_gspo_vllm": 1, "qwen3_30b_a3b_gspo_async_1node_vllm": 1, "qwen3_235b_a22b_gspo": 16}
PHASES = ("training", "weight push", "sync check", "host")


def rehearse(stem: str, layers: int | None) -> dict:
    hf = HF["235b" if "235b" in stem else "30b"]
    command = [sys.executable, "-m", "gspo_mcore.rehearse", "--config", f"configs/{stem}.yaml", "--hf-config", hf,
               "--nodes", str(CONFIGS[stem])] + (["--layers", str(layers)] if layers else [])
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    return _summary(done.stdout, stem)


def _summary(stdout: str, stem: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise SystemExit(f"rehearse_table: {stem}: no JSON line from the rehearsal")
    return json.loads(lines[-1])


def rows(stem: str, summary: dict) -> list[str]:
    out = []
    rehearsed_as = "; ".join(change.split(" (")[0] for change in summary["changes"]) or "as written"
    for role, figures in summary["roles"].items():
        cells = []
        for phase in PHASES:
            p = figures["phases"].get(phase)
            cells.append(f"{p['peak_gb']:.1f} / {p['planner_gb']:.1f} ({p['ratio']:.2f})" if p else "-")
        flops = figures["flops"]
        total = sum(flops["rehearsal"].values()), sum(flops["planner"].values())
        waits = figures["host_waits"]["update"]
        ours = sum(n for line, n in waits.items() if line.startswith("gspo_mcore/"))
        out.append(f"| `{stem}` | {summary['layers']} | {role} (rank {figures['rank']}) | {rehearsed_as} | "
                   + " | ".join(cells) + f" | {total[0]:.3e} / {total[1]:.3e} | {ours} / {sum(waits.values()) - ours} "
                   "|")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int)
    parser.add_argument("--only", nargs="*", default=list(CONFIGS))
    parser.add_argument("--from-dir", type=Path)
    args = parser.parse_args()
    print("| config | layers | rank role | rehearsed as | training GiB: rehearsal / planner (ratio) | weight push "
          "| sync check | host (offloaded optimizer) | FLOPs of a 16k step: rehearsal / planner "
          "| host waits in that step: this project / megatron-core |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for stem in args.only:
        if args.from_dir:
            summary = _summary((args.from_dir / f"{stem}.out").read_text(), stem)
        else:
            summary = rehearse(stem, args.layers)
        print("\n".join(rows(stem, summary)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
