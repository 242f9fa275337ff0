"""Benchmark: trainer -> SGLang weight sync (export + push), in bytes per second, for a tiny
and a mid-size Qwen3-MoE, against a plain copy of the same bytes (not a test).

For each size a real SGLang server (CPU) is started with the model; a one-process Megatron
trainer then pushes its weights three ways, each timed as the median of `--repeats` runs:
- `distributed`: DistributedWeightSync (gloo process group, flattened bf16 buckets);
- `disk`: save_hf_checkpoint + /update_weights_from_disk (the shared file system fallback);
- `copy`: the same number of bytes, in the same bucket sizes, broadcast over a gloo group
  to a bare receiver process: the transport alone, no export and no engine.
The last line is JSON: {"ratio_vs_copy": distributed throughput / copy throughput (the last size),
"disk_ratio_vs_copy": ..., "sizes": {SIZE: {"ratio_vs_copy", "disk_ratio_vs_copy", "bytes"}}}.

    python bench/weight_sync.py [--sizes tiny,mid] [--repeats 3] [--bucket-mb 64] [--smoke]

`--smoke`: the tiny size once (the suite's check that the bench runs).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SIZES = {
    "tiny": dict(mlp_only_layers=[]),
    # ~170M parameters (~340 MB in bf16): 48 experts of 512 in 4 layers, a 32k vocabulary.
    "mid": dict(mlp_only_layers=[], hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=4, head_dim=64, moe_intermediate_size=512, intermediate_size=1024,
                num_experts=48, num_experts_per_tok=4, vocab_size=32000),
}

_RECEIVER = """
import sys, torch
from datetime import timedelta
from sglang.srt.utils import init_custom_process_group
host, port, sizes = sys.argv[1], int(sys.argv[2]), [int(s) for s in sys.argv[3].split(",")]
repeats = int(sys.argv[4])
group = init_custom_process_group(backend="gloo", init_method=f"tcp://{host}:{port}", world_size=2, rank=1,
                                  group_name="copy", timeout=timedelta(seconds=300))
for _ in range(repeats):
    for n in sizes:
        torch.distributed.broadcast(torch.empty(n, dtype=torch.uint8), group_src=0, group=group)
"""


def _child(size: str, repeats: int, bucket_mb: int) -> dict:
    import statistics
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from gspo_mcore.config import load_config
    from gspo_mcore.megatron.qwen3_moe.bootstrap import model_from_config
    from gspo_mcore.megatron.qwen3_moe.parallel_weights import owned_hf_weights
    from gspo_mcore.megatron.qwen3_moe.tiny import make_tiny_checkpoint
    from gspo_mcore.engines.sglang.engine import SGLangEngine
    from gspo_mcore.common.processes import ManagedServer
    from gspo_mcore.engines.sglang.server import sglang_command
    from gspo_mcore.engines.sglang.sglang_cpu import server_env
    from gspo_mcore.megatron.checkpointing import save_hf_checkpoint
    from gspo_mcore.weight_sync import DistributedWeightSync, bucketed

    work = Path(tempfile.mkdtemp(prefix=f"bench-sync-{size}-"))
    hf_dir = make_tiny_checkpoint(work / "model", seed=0, dtype=torch.bfloat16, **SIZES[size])
    config = load_config(None, [f"model.hf_dir={hf_dir}"])
    arch, model = model_from_config(config)
    bucket_bytes = bucket_mb << 20
    from gspo_mcore.common.netaddr import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    timings: dict[str, list[float]] = {"distributed": [], "disk": [], "copy": []}
    with ManagedServer(sglang_command(str(hf_dir), port), url, work / "sglang.log", env=server_env()):
        control = SGLangEngine([url])
        sync = DistributedWeightSync(model, arch, "local", control, backend="gloo", master_address="127.0.0.1",
                                     bucket_bytes=bucket_bytes, dtype=torch.bfloat16)
        for i in range(repeats):
            start = time.perf_counter()
            nbytes = sync.push(f"bench-{i}")
            timings["distributed"].append(time.perf_counter() - start)
        for i in range(repeats):
            start = time.perf_counter()
            out = save_hf_checkpoint(model, arch, "local", work / "sync", hf_dir)
            control.load_from_disk(out, f"disk-{i}")
            timings["disk"].append(time.perf_counter() - start)
    # The copy baseline: the same bucket sizes, bf16 bytes, to a bare gloo receiver.
    sizes = [sum(t.numel() for _, t in bucket) * 2 for bucket in
             bucketed(owned_hf_weights(model, arch, "local"), bucket_bytes, torch.bfloat16)]
    assert sum(sizes) == nbytes
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=timedelta(seconds=300), wait_for_workers=False)
    receiver = subprocess.Popen([sys.executable, "-c", _RECEIVER, "127.0.0.1", str(store.port),
                                 ",".join(map(str, sizes)), str(repeats)], env=server_env())
    from sglang.srt.utils import init_custom_process_group

    group = init_custom_process_group(backend="gloo", store=dist.PrefixStore("copy", store), world_size=2, rank=0,
                                      group_name="copy", timeout=timedelta(seconds=300))
    buffers = [torch.randint(0, 255, (n,), dtype=torch.uint8) for n in sizes]
    for _ in range(repeats):
        start = time.perf_counter()
        for buffer in buffers:
            dist.broadcast(buffer, group_src=0, group=group)
        timings["copy"].append(time.perf_counter() - start)
    receiver.wait(timeout=300)
    median = {k: statistics.median(v) for k, v in timings.items()}
    return {"size": size, "bytes": nbytes, **{f"{k}_s": round(v, 3) for k, v in median.items()},
            **{f"{k}_MBps": round(nbytes / v / 1e6, 1) for k, v in median.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="tiny,mid")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--smoke", action="store_true", help="the tiny size, once")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        args.sizes, args.repeats = "tiny", 1
    if args.child:
        print(json.dumps(_child(args.child, args.repeats, args.bucket_mb)), flush=True)
        return
    results = {}
    for size in args.sizes.split(","):
        if size not in SIZES:
            parser.error(f"--sizes: unknown size {size!r} (known: {', '.join(SIZES)})")
        proc = subprocess.run([sys.executable, __file__, "--child", size, "--repeats", str(args.repeats),
                               "--bucket-mb", str(args.bucket_mb)], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"})
        if proc.returncode:
            sys.exit(f"error: the {size} run failed:\n{proc.stderr[-3000:]}")
        results[size] = json.loads(proc.stdout.strip().splitlines()[-1])
        r = results[size]
        print(f"{size}: {r['bytes'] / 1e6:.1f} MB  distributed {r['distributed_MBps']} MB/s  "
              f"disk {r['disk_MBps']} MB/s  copy {r['copy_MBps']} MB/s", flush=True)
    ratios = {k: {"ratio_vs_copy": round(r["copy_s"] / r["distributed_s"], 3),
                  "disk_ratio_vs_copy": round(r["copy_s"] / r["disk_s"], 3), "bytes": r["bytes"]}
              for k, r in results.items()}
    last = list(ratios.values())[-1]
    print(json.dumps({"ratio_vs_copy": last["ratio_vs_copy"], "disk_ratio_vs_copy": last["disk_ratio_vs_copy"],
                      "sizes": ratios}))


if __name__ == "__main__":
    main()
