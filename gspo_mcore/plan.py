"""Check a run's GPU layout before any GPU is touched, and estimate memory and FLOPs.

    python -m gspo_mcore.plan --config X [--nodes N] [--gpus-per-node 8] [--hf-config config.json]
                              [--gpu-memory-gb 80] [--prompt-tokens 512] [key=value ...]

Layout checks (each failure is one line naming the field): world size divisible by
TP x PP and by EP x ETP x PP, EP divides the experts, TP divides the attention heads and KV
heads (TP <= KV heads), the vocabulary splits over TP without padding, PP divides the layers,
every minibatch feeds every data-parallel rank, SGLang's GPUs fit beside the trainer's.
Then a per-GPU memory estimate (weights, gradients, optimizer states, activations at the
token budget, logits; SGLang's weights and KV cache, on a colocated GPU added to the trainer's)
and the FLOPs of one step; host memory of an offloaded optimizer.

The estimates are arithmetic on the shapes, not measurements: activations follow
Korthikanti et al. 2022 (sequence parallel, flash attention) adapted to top-k experts;
expect them within ~1.5x. Nothing here has been run on a GPU from this project's machines.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from gspo_mcore.config import Config, ConfigError, load_config
from gspo_mcore.errors import run_cli
from gspo_mcore.models.qwen3_moe.hf_config import Qwen3MoeArch, load_hf_config

GB = 1024**3
# A colocated SGLang process keeps, beyond its weights and KV cache: the CUDA context, CUDA
# graphs and its forward's activations. A stated allowance, not a measurement.
SGLANG_MARGIN_GB = 4.0


@dataclass(frozen=True)
class Layout:
    total_gpus: int
    trainer_gpus: int
    rollout_gpus: int
    dp: int
    expert_dp: int


def param_counts(arch: Qwen3MoeArch) -> dict[str, int]:
    """Parameters by kind (dense = replicated over EP; experts = split by EP)."""
    h, layers = arch.hidden_size, arch.num_layers
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    attention = h * (q + 2 * kv) + q * h + 2 * arch.head_dim + 2 * h  # qkv, o, q/k norms, 2 RMSNorms
    moe_layers = sum(arch.moe_layers)
    dense_mlp = (layers - moe_layers) * 3 * h * arch.intermediate_size
    router = moe_layers * h * arch.num_experts
    experts = moe_layers * arch.num_experts * 3 * h * arch.moe_intermediate_size
    embeddings = arch.vocab_size * h * (1 if arch.tie_word_embeddings else 2) + h
    dense = layers * attention + dense_mlp + router + embeddings
    active = dense + moe_layers * arch.num_experts_per_tok * 3 * h * arch.moe_intermediate_size
    return {"dense": dense, "experts": experts, "total": dense + experts, "active": active}


def check_layout(config: Config, arch: Qwen3MoeArch, nodes: int, gpus_per_node: int) -> Layout:
    from gspo_mcore.models.qwen3_moe.model import check_layout as check_model_layout

    d, r, t = config.distributed, config.rollout, config.train
    total = nodes * gpus_per_node
    rollout_gpus = 0 if (config.weight_sync.colocate or r.urls) else r.num_servers * r.engine_tp
    trainer = total - rollout_gpus
    if trainer <= 0:
        raise ConfigError(f"rollout: {r.num_servers} servers x engine_tp {r.engine_tp} = {rollout_gpus} GPUs "
                          f"leave none of the {total} for training")
    if r.engine_tp > gpus_per_node:
        raise ConfigError(f"rollout.engine_tp {r.engine_tp} exceeds the {gpus_per_node} GPUs of a node")
    if not (config.weight_sync.colocate or r.urls) and rollout_gpus % r.engine_tp:
        raise ConfigError("rollout: servers must not straddle nodes")
    if config.weight_sync.colocate and r.num_servers * r.engine_tp != total:
        raise ConfigError(f"weight_sync.colocate: {r.num_servers} servers x rollout.engine_tp {r.engine_tp} "
                          f"must cover the {total} GPUs the trainer shares with them")
    if arch.num_key_value_heads % r.engine_tp and r.engine_tp % arch.num_key_value_heads:
        raise ConfigError(f"rollout.engine_tp {r.engine_tp} does not split num_key_value_heads "
                          f"{arch.num_key_value_heads}")
    check_model_layout(arch, d)  # kv heads, vocab, experts, layers, FFN sizes over TP/EP/PP
    if arch.num_attention_heads % d.tensor_parallel:
        raise ConfigError(f"num_attention_heads {arch.num_attention_heads} is not divisible by "
                          f"distributed.tensor_parallel = {d.tensor_parallel}")
    for size, what in ((d.tensor_parallel * d.pipeline_parallel, "tensor_parallel x pipeline_parallel"),
                       (d.expert_parallel * d.expert_tensor_parallel * d.pipeline_parallel,
                        "expert_parallel x expert_tensor_parallel x pipeline_parallel")):
        if trainer % size:
            raise ConfigError(f"distributed: {trainer} trainer GPUs are not divisible by {what} = {size}")
    dp = trainer // (d.tensor_parallel * d.pipeline_parallel)
    expert_dp = trainer // (d.expert_parallel * d.expert_tensor_parallel * d.pipeline_parallel)
    samples = t.rollout_batch_size * t.group_size
    if samples < t.num_minibatches * dp:
        raise ConfigError(f"train: {t.rollout_batch_size} prompts x {t.group_size} responses = {samples} sequences "
                          f"cannot give each of {t.num_minibatches} minibatches one per data-parallel rank ({dp})")
    return Layout(total, trainer, rollout_gpus, dp, expert_dp)


def memory_estimate(config: Config, arch: Qwen3MoeArch, layout: Layout) -> dict[str, float]:
    """GB per trainer GPU (the busiest: first pipeline stage) and per SGLang GPU."""
    d, t = config.distributed, config.train
    counts = param_counts(arch)
    dense_local = counts["dense"] / (d.tensor_parallel * d.pipeline_parallel)
    expert_local = counts["experts"] / (d.expert_parallel * d.expert_tensor_parallel * d.pipeline_parallel)
    weight_bytes = 2 if config.model.dtype == "bfloat16" else 4
    weights = (dense_local + expert_local) * weight_bytes
    grads = (dense_local + expert_local) * 4  # fp32 gradient buffers
    shard = (lambda n, dp: n / dp) if config.optimizer.distributed_optimizer else (lambda n, dp: n)
    # fp32 main params (bf16 runs) + Adam's two moments.
    optimizer_bytes = (4 if weight_bytes == 2 else 0) + 8
    optimizer = (shard(dense_local, layout.dp) + shard(expert_local, layout.expert_dp)) * optimizer_bytes
    if config.optimizer.cpu_offload:  # in host memory; report it, it is not on the GPU
        # Adam's states and fp32 master weights, plus the pinned fp32 copies of this rank's
        # gradient shard that the offloaded step reads.
        grad_copies = (shard(dense_local, layout.dp) + shard(expert_local, layout.expert_dp)) * 4
        host_optimizer, optimizer = optimizer + grad_copies, 0.0
    tokens, h, tp = t.max_tokens_per_microbatch, arch.hidden_size, d.tensor_parallel
    layers_here = arch.num_layers // d.pipeline_parallel
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    k, f = arch.num_experts_per_tok, arch.moe_intermediate_size
    # Per token per layer, bf16: attention (norm in, qkv, flash output, o-proj in) split by TP
    # under sequence parallel; experts: k copies of the token (dispatch) and 3 FFN tensors.
    per_layer = (2 * (4 * h + q + 2 * kv + q) / tp) + 2 * k * (2 * h + 3 * f / d.expert_tensor_parallel)
    in_flight = min(d.pipeline_parallel, max(1, t.rollout_batch_size * t.group_size // (t.num_minibatches * layout.dp)))
    if config.model.recompute == "full":
        stored = layers_here * tokens * 2 * h / tp  # each layer's input only
        activations = stored * in_flight + tokens * per_layer  # + one layer recomputed at a time
    else:
        activations = layers_here * tokens * per_layer * in_flight
    # bf16 logits [s, b, v], the contiguous [b, s, v] copy GPTModel returns, their gradient,
    # plus gspo_mcore.logprobs' float32 chunk.
    from gspo_mcore.logprobs import DEFAULT_CHUNK_ELEMENTS

    logits = arch.vocab_size / tp * tokens * (2 + 2 + 2) + DEFAULT_CHUNK_ELEMENTS * 4
    trainer = {"weights": weights, "gradients": grads, "optimizer": optimizer, "activations": activations,
               "logits": logits}
    out = {f"trainer_{k}_gb": v / GB for k, v in trainer.items()}
    out["trainer_total_gb"] = sum(trainer.values()) / GB
    if config.optimizer.cpu_offload:
        out["host_optimizer_gb_per_gpu"] = host_optimizer / GB
    etp = config.rollout.engine_tp
    out["sglang_weights_gb"] = counts["total"] * 2 / etp / GB
    kv_per_token = 2 * arch.num_layers * max(1, arch.num_key_value_heads // etp) * arch.head_dim * 2
    out["sglang_kv_bytes_per_token"] = kv_per_token
    if config.weight_sync.colocate:  # what the engine holds on a GPU the trainer shares
        kv_gb = config.rollout.max_total_tokens * kv_per_token / GB
        out["sglang_resident_gb"] = out["sglang_weights_gb"] + kv_gb + SGLANG_MARGIN_GB
    return out


def flops_per_step(config: Config, arch: Qwen3MoeArch, prompt_tokens: int) -> dict[str, float]:
    """Upper bound at full-length responses: generation 2N per token; training 6N per token
    per epoch (no old-policy forward: GSPO uses the engine's log-probs); attention included."""
    t, r = config.train, config.rollout
    counts = param_counts(arch)
    sequences = t.rollout_batch_size * t.group_size
    seq_len = prompt_tokens + r.max_new_tokens
    attention = 2 * 2 * arch.num_layers * arch.num_attention_heads * arch.head_dim * seq_len / 2  # causal, per token
    generated = sequences * r.max_new_tokens
    train_tokens = sequences * seq_len
    generation = generated * (2 * counts["active"] + attention)
    training = t.ppo_epochs * train_tokens * 3 * (2 * counts["active"] + attention)
    if t.recompute_old_logprobs:
        training += train_tokens * (2 * counts["active"] + attention)
    if config.model.recompute == "full":
        training += t.ppo_epochs * train_tokens * (2 * counts["active"] + attention)
    return {"rollout_tflops": generation / 1e12, "train_tflops": training / 1e12,
            "tokens_per_step": train_tokens}


def check_colocated(config: Config, memory: dict[str, float], gpu_memory_gb: float) -> None:
    """A colocated GPU in its two phases: training (the engine released its weights and KV
    cache and keeps its margin) and the push (the trainer emptied its cache, keeping weights,
    gradients, optimizer states and one bucket; the engine resumed weights and KV cache)."""
    static = sum(memory[f"trainer_{k}_gb"] for k in ("weights", "gradients", "optimizer"))
    bucket = config.weight_sync.bucket_mb / 1024 * 2  # the flat bucket and its engine-dtype copy
    phases = {"training": memory["trainer_total_gb"] + SGLANG_MARGIN_GB,
              "the weight push": static + bucket + memory["sglang_resident_gb"]}
    for phase, total in phases.items():
        if total > gpu_memory_gb:
            raise ConfigError(
                f"weight_sync.colocate: during {phase} the trainer and SGLang (weights "
                f"{memory['sglang_weights_gb']:.1f} GB, KV cache for rollout.max_total_tokens "
                f"{config.rollout.max_total_tokens}, {SGLANG_MARGIN_GB:g} GB margin) need an estimated {total:.1f} GB "
                f"per GPU > {gpu_memory_gb:g} GB: lower rollout.max_total_tokens or train.max_tokens_per_microbatch, "
                "raise rollout.engine_tp, or set model.recompute: full / optimizer.cpu_offload: true")
    memory["colocated_training_gb"], memory["colocated_push_gb"] = phases["training"], phases["the weight push"]


def plan(config: Config, arch: Qwen3MoeArch, nodes: int, gpus_per_node: int, gpu_memory_gb: float,
         prompt_tokens: int) -> dict:
    layout = check_layout(config, arch, nodes, gpus_per_node)
    memory = memory_estimate(config, arch, layout)
    if "sglang_resident_gb" in memory:
        check_colocated(config, memory, gpu_memory_gb)
    if memory["trainer_total_gb"] > gpu_memory_gb:
        raise ConfigError(
            f"estimated {memory['trainer_total_gb']:.1f} GB per trainer GPU > {gpu_memory_gb:g} GB: raise "
            "distributed.expert_parallel / pipeline_parallel, or lower train.max_tokens_per_microbatch, "
            "or set model.recompute: full"
        )
    if layout.rollout_gpus:
        free = gpu_memory_gb * 0.85 - memory["sglang_weights_gb"]
        if free <= 0:
            raise ConfigError(f"rollout.engine_tp {config.rollout.engine_tp}: SGLang's weights alone "
                              f"({memory['sglang_weights_gb']:.1f} GB) do not fit a {gpu_memory_gb:g} GB GPU")
        memory["sglang_kv_cache_tokens"] = int(free * GB / memory["sglang_kv_bytes_per_token"])
    counts = param_counts(arch)
    return {"gpus": layout.total_gpus, "trainer_gpus": layout.trainer_gpus, "rollout_gpus": layout.rollout_gpus,
            "data_parallel": layout.dp, "expert_data_parallel": layout.expert_dp,
            "params_total_b": counts["total"] / 1e9, "params_active_b": counts["active"] / 1e9,
            **memory, **flops_per_step(config, arch, prompt_tokens)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gspo_mcore.plan", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--hf-config", help="the model's config.json (default: model.hf_dir/config.json)")
    parser.add_argument("--gpu-memory-gb", type=float, default=80.0)
    parser.add_argument("--prompt-tokens", type=int, default=512, help="prompt length for the FLOPs bound")
    parser.add_argument("--shell", action="store_true", help="print KEY=value lines for the launch scripts")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args(argv)
    import warnings

    warnings.filterwarnings("ignore", module="megatron")  # "Apex / TE not installed" on planning machines
    config = load_config(args.config, args.overrides)
    if args.nodes < 1 or args.gpus_per_node < 1:
        raise ConfigError("--nodes and --gpus-per-node must be >= 1")
    arch = load_hf_config(args.hf_config or Path(config.model.hf_dir) / "config.json")
    result = plan(config, arch, args.nodes, args.gpus_per_node, args.gpu_memory_gb, args.prompt_tokens)
    d = config.distributed
    if args.shell:  # validated above: the scripts start nothing for a layout that cannot work
        r = config.rollout
        for key, value in (("TRAINER_GPUS", result["trainer_gpus"]), ("ROLLOUT_GPUS", result["rollout_gpus"]),
                           ("NUM_SERVERS", r.num_servers), ("ENGINE_TP", r.engine_tp),
                           ("COLOCATE", int(config.weight_sync.colocate)), ("EXTERNAL_SERVERS", int(bool(r.urls)))):
            print(f"GSPO_{key}={value}")
        return 0
    print(f"{result['gpus']} GPUs: {result['trainer_gpus']} trainer (TP {d.tensor_parallel} x PP {d.pipeline_parallel}"
          f" x DP {result['data_parallel']}; experts EP {d.expert_parallel} x ETP {d.expert_tensor_parallel} x "
          f"expert-DP {result['expert_data_parallel']}), {result['rollout_gpus']} SGLang"
          f"{' (colocated)' if config.weight_sync.colocate else ''}")
    print(f"model: {result['params_total_b']:.1f}B parameters, {result['params_active_b']:.2f}B active per token")
    print("per trainer GPU (GB): " + ", ".join(
        f"{k.removeprefix('trainer_').removesuffix('_gb')} {result[k]:.1f}" for k in result
        if k.startswith("trainer_") and k.endswith("_gb")))
    if "host_optimizer_gb_per_gpu" in result:
        print(f"host memory: {result['host_optimizer_gb_per_gpu']:.1f} GB per trainer GPU (offloaded Adam + fp32 "
              f"gradient copies), {result['host_optimizer_gb_per_gpu'] * args.gpus_per_node:.0f} GB per node")
    if "sglang_resident_gb" in result:
        print(f"colocated, per GPU of {args.gpu_memory_gb:g} GB: {result['colocated_training_gb']:.1f} while training, "
              f"{result['colocated_push_gb']:.1f} during the weight push (SGLang {result['sglang_resident_gb']:.1f})")
    print(f"per SGLang GPU: weights {result['sglang_weights_gb']:.1f} GB"
          + (f", KV cache for ~{result['sglang_kv_cache_tokens']:,} tokens" if "sglang_kv_cache_tokens" in result else ""))
    print(f"one step (upper bound, full-length responses): rollout {result['rollout_tflops']:.0f} TFLOP, "
          f"train {result['train_tflops']:.0f} TFLOP")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
