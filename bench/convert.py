"""Benchmark of checkpoint_convert against `cp -r` on the same disk (not a test).

Makes a synthetic Qwen3-30B-A3B-structured checkpoint (128 experts, top-8, head_dim 128,
4 KV heads; hidden 1024 so that it is ~3 GB), then in one run times (a) `cp -r` of the
safetensors files, (b) hf-to-mcore, (c) mcore-to-hf, each in a fresh process after `sync`.
Prints GB/s, the ratios b/a and c/a, and peak RSS of b and c; the last line is JSON.

    python bench/convert.py [--work-dir DIR] [--layers N] [--smoke]

`--smoke`: one layer of a 256-wide model (megabytes): the suite's check that the bench runs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from checkpoint_convert.synthetic import QWEN3_30B_A3B, write_synthetic_checkpoint

# Peak RSS from VmHWM: unlike ru_maxrss it is not inherited from the parent across fork+exec.
_CHILD = """
import sys, time
from checkpoint_convert.convert import hf_to_mcore, mcore_to_hf
start = time.perf_counter()
if sys.argv[1] == "hf-to-mcore":
    hf_to_mcore(sys.argv[2], sys.argv[3], quiet=True)
else:
    mcore_to_hf(sys.argv[2], sys.argv[4], sys.argv[3], quiet=True)
seconds = time.perf_counter() - start
hwm_kb = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(seconds, hwm_kb / 2**20)
"""


def _size_gb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 1e9


def _timed_child(*args) -> tuple[float, float]:
    subprocess.run(["sync"], check=True)
    out = subprocess.run([sys.executable, "-c", _CHILD, *map(str, args)], check=True, capture_output=True, text=True)
    seconds, rss_gb = map(float, out.stdout.split())
    return seconds, rss_gb


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", help="where to write (default: a temporary directory, removed after)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--smoke", action="store_true", help="one layer of a 256-wide model")
    args = parser.parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-convert-"))
    try:
        hf = work / "hf"
        config = {**QWEN3_30B_A3B, "hidden_size": 1024, "moe_intermediate_size": 384, "intermediate_size": 3072,
                  "num_hidden_layers": args.layers}
        if args.smoke:
            config.update(hidden_size=256, moe_intermediate_size=32, intermediate_size=256, num_hidden_layers=1,
                          vocab_size=4096)
        print(f"writing a synthetic checkpoint to {hf} ...", flush=True)
        write_synthetic_checkpoint(hf, config)
        gb = _size_gb(hf)

        subprocess.run(["sync"], check=True)
        start = time.perf_counter()
        subprocess.run(["cp", "-r", str(hf), str(work / "copy")], check=True)
        cp_s = time.perf_counter() - start
        to_mcore_s, to_mcore_rss = _timed_child("hf-to-mcore", hf, work / "mcore")
        to_hf_s, to_hf_rss = _timed_child("mcore-to-hf", work / "mcore", work / "back", hf)

        print(f"checkpoint: {gb:.2f} GB in {len(list(hf.glob('*.safetensors')))} files")
        for label, seconds in (("cp -r", cp_s), ("hf-to-mcore", to_mcore_s), ("mcore-to-hf", to_hf_s)):
            print(f"{label:12s} {seconds:7.2f} s  {gb / seconds:6.2f} GB/s")
        print(f"peak RSS: hf-to-mcore {to_mcore_rss:.2f} GB, mcore-to-hf {to_hf_rss:.2f} GB")
        print(json.dumps({
            "hf_to_mcore_vs_cp": round(cp_s / to_mcore_s, 3),
            "mcore_to_hf_vs_cp": round(cp_s / to_hf_s, 3),
            "peak_rss_gb_hf_to_mcore": round(to_mcore_rss, 3),
            "peak_rss_gb_mcore_to_hf": round(to_hf_rss, 3),
            "checkpoint_gb": round(gb, 3),
        }))
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
