"""Benchmark: rank 0's CPU time per response at the Qwen3-30B-A3B shape, and what it leaves of one
core for the training loop (not a test).

    python bench/rank0.py [--response-tokens 8192] [--prompt-tokens 512] [--tokens-per-s 50000] [--smoke]

Rank 0 receives every response of a rollout node and hands the batch to the other ranks. Per
response it: parses SGLang's `/generate` body (`decode_generate_body`: the long arrays with numpy
from the raw bytes), validates it (`parse_generate_response`: one finite log-prob per token, ids
in the vocabulary, per-token weight versions from the spans, the routed experts of every input
token in 48 MoE layers x top-8, decoded from base64 into uint8), and pickles it (what
`broadcast_object_list` sends the other ranks). A canned body of the 30B shape (an 8192-token
response to a 512-token prompt, its versions spanning two weight versions, routed experts
[8703, 48, 8]) is processed `--repeats` times in this process; CPU time is the process's (not
wall). The HTTP receive is bench/client.py's (about 0.8 CPU-s per million tokens).
Last line: {"cpu_ms_per_response": ..., "core_share_at_rate": the share of one core rank 0
spends at --tokens-per-s, "core_left_for_training": 1 - that, "pickled_mb_per_response": ...,
"routed_experts_mb_per_response": ...}.
"""

from __future__ import annotations

import argparse
import base64
import json
import pickle
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gspo_mcore.engines.sglang.response import decode_generate_body, parse_generate_response  # noqa: E402

LAYERS, TOP_K, EXPERTS, VOCAB = 48, 8, 128, 151_936  # Qwen3-30B-A3B


def canned_body(prompt_tokens: int, response_tokens: int, seed: int = 0) -> tuple[list[int], bytes]:
    """A prompt and SGLang's answer to it (return_logprob, logprob_start_len -1, routed experts)."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, VOCAB, prompt_tokens).tolist()
    output = rng.integers(0, VOCAB, response_tokens).tolist()
    logprobs = (-rng.exponential(1.0, response_tokens)).tolist()
    routed = rng.integers(0, EXPERTS, (prompt_tokens + response_tokens - 1, LAYERS, TOP_K), dtype=np.int32)
    half = response_tokens // 2
    meta = {"output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, output)],
            "finish_reason": {"type": "length", "length": response_tokens}, "weight_version": "step-1",
            "weight_versions": [{"version": "step-0", "start": 0, "end": half},
                                {"version": "step-1", "start": half, "end": response_tokens}],
            "routed_experts": base64.b64encode(routed.tobytes()).decode(), "completion_tokens": response_tokens,
            "prompt_tokens": prompt_tokens}
    return prompt, json.dumps({"output_ids": output, "meta_info": meta}).encode()


def measure(prompt: list[int], body: bytes, repeats: int) -> tuple[float, int, int]:
    """(CPU seconds per response, pickled bytes, routed-expert bytes)."""
    began = time.process_time()
    for _ in range(repeats):
        rollout = parse_generate_response("r", prompt, decode_generate_body(body), VOCAB, None,
                                          (LAYERS, TOP_K), oldest_version=0)
        pickled = pickle.dumps(rollout, protocol=pickle.HIGHEST_PROTOCOL)
    return (time.process_time() - began) / repeats, len(pickled), rollout.routed_experts.nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--response-tokens", type=int, default=8192)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--tokens-per-s", type=float, default=50_000, help="response tokens rank 0 ingests per second")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="a 512-token response, 3 repeats")
    args = parser.parse_args()
    if args.smoke:
        args.response_tokens, args.prompt_tokens, args.repeats = 512, 64, 3
    prompt, body = canned_body(args.prompt_tokens, args.response_tokens)
    cpu_s, pickled, routed = measure(prompt, body, args.repeats)
    per_s = args.tokens_per_s / args.response_tokens  # responses a second at that rate
    share = cpu_s * per_s
    print(f"a {args.response_tokens}-token response (prompt {args.prompt_tokens}), body {len(body) / 1e6:.1f} MB: "
          f"{cpu_s * 1e3:.1f} CPU-ms to parse, validate and pickle; pickled {pickled / 1e6:.1f} MB "
          f"(routed experts {routed / 1e6:.1f} MB as uint8)")
    print(f"at {args.tokens_per_s:,.0f} tokens/s ({per_s:.1f} responses/s): {share:.1%} of one core, "
          f"{1 - share:.1%} left for the training loop")
    print(json.dumps({"cpu_ms_per_response": round(cpu_s * 1e3, 2), "core_share_at_rate": round(share, 4),
                      "core_left_for_training": round(1 - share, 4), "pickled_mb_per_response": round(pickled / 1e6, 2),
                      "routed_experts_mb_per_response": round(routed / 1e6, 2),
                      "response_tokens": args.response_tokens, "tokens_per_s": args.tokens_per_s}))


if __name__ == "__main__":
    main()
