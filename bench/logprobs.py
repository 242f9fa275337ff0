"""Benchmark: token log-probs (+ entropy) of T=4096 tokens over a 151,936-word vocabulary from
hidden states of width 2048 (Qwen3-30B-A3B's), the output layer included, forward and backward:
naive `log_softmax` on the logits vs gspo_mcore.gspo.logprobs on the logits (chunked) vs
gspo_mcore.gspo.logprobs on `LinearLogits` (fused: the output layer and the log-probs a block of
the vocabulary at a time, the logits never whole) (not a test).

Each variant runs in a fresh process; peak memory is the peak RSS during the measured step
(VmHWM, reset just before it) minus the RSS before it (hidden states and the output weight
already allocated, in bf16 as the model holds them). The last line is JSON: {"peak_mem_ratio":
chunked/naive, "time_ratio": chunked/naive, "fused_peak_ratio_vs_chunked": fused/chunked,
"fused_time_ratio_vs_chunked": fused/chunked}.

    python bench/logprobs.py [--tokens 4096] [--vocab 151936] [--hidden 2048] [--smoke]

`--smoke`: 256 tokens x 4096 vocabulary x 64 wide (the suite's check that the bench runs).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

_CHILD = """
import sys, time, torch
torch.set_num_threads(2)
variant, tokens, vocab, width = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])

def hwm_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

g = torch.Generator().manual_seed(0)
hidden = torch.randn(tokens, width, generator=g, dtype=torch.bfloat16).requires_grad_(True)
weight = (torch.randn(vocab, width, generator=g) / width ** 0.5).bfloat16().requires_grad_(True)
target = torch.randint(0, vocab, (tokens,), generator=g)
weights = torch.randn(tokens, generator=g)
from gspo_mcore.gspo.logprobs import LinearLogits, token_logprobs
open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM to the current RSS (Linux >= 4.0)
base = rss_mb()
start = time.perf_counter()
if variant == "naive":
    log_p = (hidden @ weight.t()).float().log_softmax(-1)
    logprobs = log_p.gather(-1, target[:, None])[:, 0]
    entropy = -(log_p.exp() * log_p).sum(-1).detach()
elif variant == "chunked":
    logprobs, entropy = token_logprobs(hidden @ weight.t(), target, with_entropy=True)
else:
    logprobs, entropy = token_logprobs(LinearLogits(hidden, weight), target, with_entropy=True)
(logprobs * weights).sum().backward()
seconds = time.perf_counter() - start
print(seconds, hwm_mb() - base, float(logprobs.sum()), float(entropy.sum()))
"""

VARIANTS = {"naive": "naive log_softmax", "chunked": "gspo_mcore chunked", "fused": "gspo_mcore fused"}


def run(variant: str, tokens: int, vocab: int, width: int) -> tuple[float, float, float, float]:
    out = subprocess.run([sys.executable, "-c", _CHILD, variant, str(tokens), str(vocab), str(width)],
                         check=True, capture_output=True, text=True)
    return tuple(map(float, out.stdout.split()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=2048, help="the output layer's input width")
    parser.add_argument("--smoke", action="store_true", help="256 tokens x 4096 vocabulary x 64 wide")
    args = parser.parse_args()
    if args.smoke:
        args.tokens, args.vocab, args.hidden = 256, 4096, 64
    figures = {name: run(name, args.tokens, args.vocab, args.hidden) for name in VARIANTS}
    logits_mb = args.tokens * args.vocab * 2 / 2**20
    print(f"logits: {args.tokens} x {args.vocab} bf16 = {logits_mb:.0f} MB, from {args.hidden}-wide hidden states")
    for name, label in VARIANTS.items():
        seconds, peak_mb, _, _ = figures[name]
        print(f"{label + ':':21s}{seconds:7.2f} s, peak extra memory {peak_mb:7.0f} MB")
    print("same results: sum of log-probs " + " / ".join(f"{figures[n][2]:.3f}" for n in VARIANTS)
          + ", entropy " + " / ".join(f"{figures[n][3]:.3f}" for n in VARIANTS))
    (naive_s, naive_mb, *_), (chunked_s, chunked_mb, *_), (fused_s, fused_mb, *_) = (figures[n] for n in VARIANTS)
    print(json.dumps({"peak_mem_ratio": round(chunked_mb / naive_mb, 3), "time_ratio": round(chunked_s / naive_s, 3),
                      "fused_peak_ratio_vs_chunked": round(fused_mb / chunked_mb, 3),
                      "fused_time_ratio_vs_chunked": round(fused_s / chunked_s, 3)}))


if __name__ == "__main__":
    main()
