"""Benchmark: token log-probs (+ entropy) of T=4096 tokens over a 151,936-word vocabulary,
forward and backward, naive `log_softmax` vs gspo_mcore.gspo.logprobs (not a test).

Each variant runs in a fresh process; peak memory is the peak RSS during the measured step
(VmHWM, reset just before it) minus the RSS before it (logits already allocated, in bf16 as
the output layer gives them).
The last line is JSON: {"peak_mem_ratio": project/naive, "time_ratio": project/naive}.

    python bench/logprobs.py [--tokens 4096] [--vocab 151936] [--smoke]

`--smoke`: 256 tokens x 4096 vocabulary (the suite's check that the bench runs).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

_CHILD = """
import sys, time, torch
torch.set_num_threads(2)
variant, tokens, vocab = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

def hwm_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

g = torch.Generator().manual_seed(0)
logits = torch.randn(tokens, vocab, generator=g, dtype=torch.bfloat16).requires_grad_(True)
target = torch.randint(0, vocab, (tokens,), generator=g)
weights = torch.randn(tokens, generator=g)
from gspo_mcore.gspo.logprobs import token_logprobs
open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM to the current RSS (Linux >= 4.0)
base = rss_mb()
start = time.perf_counter()
if variant == "naive":
    log_p = logits.float().log_softmax(-1)
    logprobs = log_p.gather(-1, target[:, None])[:, 0]
    entropy = -(log_p.exp() * log_p).sum(-1).detach()
else:
    logprobs, entropy = token_logprobs(logits, target, with_entropy=True)
(logprobs * weights).sum().backward()
seconds = time.perf_counter() - start
print(seconds, hwm_mb() - base, float(logprobs.sum()), float(entropy.sum()))
"""


def run(variant: str, tokens: int, vocab: int) -> tuple[float, float, float, float]:
    out = subprocess.run([sys.executable, "-c", _CHILD, variant, str(tokens), str(vocab)],
                         check=True, capture_output=True, text=True)
    return tuple(map(float, out.stdout.split()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--smoke", action="store_true", help="256 tokens x 4096 vocabulary")
    args = parser.parse_args()
    if args.smoke:
        args.tokens, args.vocab = 256, 4096
    logits_mb = args.tokens * args.vocab * 2 / 2**20
    naive_s, naive_mb, naive_sum, naive_h = run("naive", args.tokens, args.vocab)
    ours_s, ours_mb, ours_sum, ours_h = run("project", args.tokens, args.vocab)
    print(f"logits: {args.tokens} x {args.vocab} bf16 = {logits_mb:.0f} MB")
    print(f"naive log_softmax: {naive_s:6.2f} s, peak extra memory {naive_mb:7.0f} MB")
    print(f"gspo_mcore:        {ours_s:6.2f} s, peak extra memory {ours_mb:7.0f} MB")
    print(f"same results: sum of log-probs {naive_sum:.3f} vs {ours_sum:.3f}, entropy {naive_h:.3f} vs {ours_h:.3f}")
    print(json.dumps({"peak_mem_ratio": round(ours_mb / naive_mb, 3), "time_ratio": round(ours_s / naive_s, 3)}))


if __name__ == "__main__":
    main()
