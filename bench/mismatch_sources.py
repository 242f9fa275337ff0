"""Benchmark (not a test): where the train-inference mismatch at theta_old comes from.

GSPO's importance ratio s_i = exp(mean_t(log pi_theta - log pi_old)) (eq. 7) is clipped to
[1 - 3e-4, 1 + 4e-4]; with pi_old the engine's log-probs, at theta == theta_old it should be 1,
and whatever it is instead is mismatch. This script samples `--sequences` responses of a task
from a real SGLang server (CPU) at the config's initial weights, once with a bf16 and once with
an fp32 engine (every request's sampling seeded from the config's `train.seed`: a rerun samples
the same responses), and compares the engine's per-token log-probs (the ones the trainer trains
against) with transformers forwards of the same Hugging Face checkpoint, log_softmax of
logits / temperature gathered at the sampled tokens:

  bf16 engine vs  fp32           the trainer's numerics (Megatron in fp32 = transformers fp32 to ~3e-6)
                  bf16 weights   weights rounded to bf16, computed in fp32
                  bf16           transformers in bf16 (weights and compute)
                  engine prefill the same server's prefill of the whole sequence (one request each):
                                 what decoding token by token, in a batch, adds
  fp32 engine vs  fp32, engine prefill

Per comparison, d = trainer - engine per response token: mean (bias), std, the bias's
t-statistic (bias / (std / sqrt(n))), median |d| and the share of |d| > 0.1; per sequence,
log s_i = mean_t d: mean |log s_i|, the share outside the clip band, and what |log s_i| would
be from the per-token noise alone (zero bias: std / sqrt(L) * sqrt(2 / pi)); by position
(quarters of the response), mean d and mean |d|; the share of (token, MoE layer) pairs whose
top-k experts differ from the fp32 forward's. Two remedies are scored on the same data: a
constant offset (the mean log s_i of the first half of the sequences, "the first minibatch")
subtracted from the second half's log s_i, and the band that would hold 90% of sequences.

    python -m gspo_mcore.tasks.long outputs/long_task
    OMP_NUM_THREADS=1 python bench/mismatch_sources.py [--config configs/long_cpu.yaml] [--sequences 32] [--smoke]

`--smoke`: 4 sequences of 16 tokens (the suite's check that the bench runs).

The last line is JSON: one object per comparison.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from functools import partial
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def engine_rollouts(config, dtype: str, prompts: list[list[int]], vocab_size: int,
                    log_dir: Path) -> tuple[list, list[list[float]]]:
    """Responses sampled by a fresh server in `dtype` (decode log-probs; each request seeded from
    `train.seed`, so a rerun samples the same tokens), and the same server's prefill log-probs of
    the same response tokens."""
    import dataclasses

    from gspo_mcore.common.netaddr import free_port
    from gspo_mcore.common.seeds import request_seed
    from gspo_mcore.engines.sglang.engine import SGLangEngine
    from gspo_mcore.common.processes import ManagedServer
    from gspo_mcore.engines.sglang.server import server_for_config

    port = free_port()
    config = dataclasses.replace(config, rollout=dataclasses.replace(config.rollout, engine_dtype=dtype))
    cmd, env = server_for_config(config, port)
    url = f"http://127.0.0.1:{port}"
    with ManagedServer(cmd, url, log_dir / f"sglang_{dtype}.log", env=env):
        params = {"max_new_tokens": config.rollout.max_new_tokens, "temperature": config.rollout.temperature}
        seeds = [request_seed(config.train.seed, "mismatch_sources", i) for i in range(len(prompts))]
        rollouts = SGLangEngine([url]).client(vocab_size).generate(prompts, params, seeds=seeds)
        prefill = SGLangEngine([url]).prompt_logprobs(url, [r.prompt_ids + r.response_ids for r in rollouts])
    return rollouts, [p[len(r.prompt_ids) - 1:] for r, p in zip(rollouts, prefill)]


def forward_logprobs(model, rollouts, temperature: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per rollout: log-probs of the response tokens (float64) and the top-k expert sets of
    every response token in every MoE layer (layers x tokens x k)."""
    logprobs, experts = [], []
    k = model.config.num_experts_per_tok
    for r in rollouts:
        ids = torch.tensor([r.prompt_ids + r.response_ids])
        with torch.no_grad():
            out = model(input_ids=ids[:, :-1], output_router_logits=True)
        start = len(r.prompt_ids) - 1
        logits = out.logits[0, start:].double() / temperature
        logprobs.append(logits.log_softmax(-1).gather(-1, torch.tensor(r.response_ids)[:, None])[:, 0])
        experts.append(torch.stack([layer[start:].topk(k, dim=-1).indices.sort(-1).values
                                    for layer in out.router_logits]))
    return logprobs, experts


def trainer_variants(hf_dir: str) -> dict:
    """The checkpoint as the fp32 trainer sees it, with weights rounded to bf16 (fp32 compute),
    and in bf16."""
    from transformers import AutoModelForCausalLM

    fp32 = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    rounded = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for param in rounded.parameters():
            param.copy_(param.to(torch.bfloat16).float())
    bf16 = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).eval()
    return {"fp32": fp32, "bf16 weights": rounded, "bf16": bf16}


def compare(trainer: list[torch.Tensor], engine: list[list[float]], clip_low: float, clip_high: float,
            positions: int) -> dict:
    diffs = [t.double() - torch.tensor(e, dtype=torch.float64) for t, e in zip(trainer, engine)]
    tokens = torch.cat(diffs)
    bias, std = tokens.mean().item(), tokens.std().item()
    log_s = torch.tensor([d.mean().item() for d in diffs], dtype=torch.float64)
    band = (math.log(1 - clip_low), math.log(1 + clip_high))

    def out_of_band(values: torch.Tensor) -> float:
        return ((values < band[0]) | (values > band[1])).double().mean().item()

    # The heavy tail (|d| > 0.1: a token whose MoE routing flipped, see routing_flips) vs the bulk.
    bulk = [torch.where(d.abs() > 0.1, 0.0, d) for d in diffs]
    log_s_bulk = torch.tensor([d.mean().item() for d in bulk], dtype=torch.float64)
    half = len(log_s) // 2
    offset = log_s[:half].mean()  # measured on "the first minibatch", applied to the rest
    by_position = {}
    quarter = max(1, math.ceil(positions / 4))
    index = torch.cat([torch.arange(len(d)) for d in diffs])
    for start in range(0, positions, quarter):
        chosen = tokens[(index >= start) & (index < start + quarter)]
        if len(chosen):
            by_position[f"{start}-{start + quarter - 1}"] = {"bias": chosen.mean().item(),
                                                             "mean_abs": chosen.abs().mean().item()}
    design = torch.stack([index.double(), torch.ones_like(tokens)], 1)
    slope = torch.linalg.lstsq(design, tokens.abs()[:, None]).solution  # |d| ~ slope * position + c
    noise_only = sum(std / math.sqrt(len(d)) * math.sqrt(2 / math.pi) for d in diffs) / len(diffs)
    return {
        "tokens": len(tokens), "token_bias": bias, "token_std": std,
        "bias_t": bias / max(std / math.sqrt(len(tokens)), 1e-30),
        "token_median": tokens.median().item(), "token_median_abs": tokens.abs().median().item(),
        "token_share_abs_over_0.1": (tokens.abs() > 0.1).double().mean().item(),
        "seq_mean_abs_log_ratio": log_s.abs().mean().item(), "seq_mean_log_ratio": log_s.mean().item(),
        "seq_out_of_band": out_of_band(log_s),
        "seq_mean_abs_log_ratio_tail_zeroed": log_s_bulk.abs().mean().item(),
        "seq_out_of_band_tail_zeroed": out_of_band(log_s_bulk),
        "seq_noise_only_abs_log_ratio": noise_only,
        "seq_out_of_band_after_first_half_offset": out_of_band(log_s[half:] - offset),
        "seq_band_for_90pct": torch.quantile(log_s.abs(), 0.9).item(),
        "abs_d_slope_per_10_positions": 10 * slope[0, 0].item(),
        "by_position": by_position,
    }


def routing_flips(experts: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """Share of (MoE layer, token) pairs whose top-k expert set differs from the reference's."""
    differ = torch.cat([(e != r).any(-1).flatten() for e, r in zip(experts, reference)])
    return differ.double().mean().item()


def flipped_tokens(experts: list[torch.Tensor], reference: list[torch.Tensor]) -> torch.Tensor:
    """Per response token (all rollouts concatenated): routed differently in any MoE layer."""
    return torch.cat([(e != r).any(-1).any(0) for e, r in zip(experts, reference)])


def main(argv=None) -> int:
    from gspo_mcore.config import load_config
    from gspo_mcore.data import PromptDataset, chat_prompt_ids
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "long_cpu.yaml"))
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--smoke", action="store_true", help="4 sequences of 16 tokens")
    parser.add_argument("overrides", nargs="*", help="config key=value overrides")
    args = parser.parse_args(argv)
    if args.smoke:
        args.sequences, args.overrides = 4, ["rollout.max_new_tokens=16", *args.overrides]
    config_path = Path(args.config).resolve()
    os.chdir(REPO)  # the config's paths are relative to the repository
    config = load_config(config_path, args.overrides)
    if not Path(config.model.hf_dir, "config.json").is_file():
        sys.exit(f"{config.model.hf_dir}: no model; write the task first (python -m gspo_mcore.tasks.long ...)")
    tokenizer = AutoTokenizer.from_pretrained(config.data.tokenizer_dir or config.model.hf_dir)
    dataset = PromptDataset.load(config.data.path)
    prompts = [chat_prompt_ids(tokenizer, dataset[i].messages) for i in range(args.sequences)]
    models = trainer_variants(config.model.hf_dir)
    score = partial(compare, clip_low=config.loss.clip_low, clip_high=config.loss.clip_high,
                    positions=config.rollout.max_new_tokens)
    results = {}
    with tempfile.TemporaryDirectory() as log_dir:
        for engine_dtype, variants in (("bfloat16", ("fp32", "bf16 weights", "bf16")), ("float32", ("fp32",))):
            rollouts, prefill = engine_rollouts(config, engine_dtype, prompts, len(tokenizer), Path(log_dir))
            engine = [r.logprobs for r in rollouts]
            forwards = {name: forward_logprobs(models[name], rollouts, config.rollout.temperature) for name in models}
            engine_name = "bf16 engine" if engine_dtype == "bfloat16" else "fp32 engine"
            for name in variants:
                logprobs, experts = forwards[name]
                results[f"{engine_name} vs {name} trainer"] = {
                    **score(logprobs, engine),
                    "routing_flips_vs_fp32": routing_flips(experts, forwards["fp32"][1]),
                }
            if engine_dtype == "bfloat16":  # no engine: what bf16 alone does, split by routing flips
                (bf16, bf16_experts), (fp32, fp32_experts) = forwards["bf16"], forwards["fp32"]
                flips = flipped_tokens(bf16_experts, fp32_experts)
                d = (torch.cat(bf16) - torch.cat(fp32)).abs()
                results["bf16 trainer vs fp32 trainer"] = {
                    **score(bf16, [f.tolist() for f in fp32]),
                    "routing_flips_vs_fp32": routing_flips(bf16_experts, fp32_experts),
                    "tokens_flipped": flips.double().mean().item(),
                    "mean_abs_d_flipped_tokens": d[flips].mean().item() if flips.any() else None,
                    "mean_abs_d_other_tokens": d[~flips].mean().item(),
                }
            results[f"{engine_name} decode vs its prefill"] = score([torch.tensor(p) for p in prefill], engine)
            lengths = [len(r.response_ids) for r in rollouts]
            print(f"{engine_name}: {len(rollouts)} responses, mean length {sum(lengths) / len(lengths):.1f}",
                  flush=True)
    print(f"{'comparison':38} {'bias':>9} {'std':>8} {'bias t':>7} {'|log s|':>8} {'noise':>8} {'no tail':>8} "
          f"{'oob':>5} {'oob-off':>7} {'slope':>8} {'flips':>6}")
    for name, r in results.items():
        print(f"{name:38} {r['token_bias']:9.2e} {r['token_std']:8.2e} {r['bias_t']:7.1f} "
              f"{r['seq_mean_abs_log_ratio']:8.2e} {r['seq_noise_only_abs_log_ratio']:8.2e} "
              f"{r['seq_mean_abs_log_ratio_tail_zeroed']:8.2e} {r['seq_out_of_band']:5.2f} "
              f"{r['seq_out_of_band_after_first_half_offset']:7.2f} {r['abs_d_slope_per_10_positions']:8.1e} "
              f"{r.get('routing_flips_vs_fp32', float('nan')):6.3f}")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
