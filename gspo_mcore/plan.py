"""Check a run's GPU layout before any GPU is touched, and estimate memory, disk and FLOPs.

    python -m gspo_mcore.plan --config X [--nodes N] [--gpus-per-node 8] [--hf-config config.json]
                              [--gpu-memory-gb 79.6] [--prompt-tokens 512] [--shell] [key=value ...]

Layout checks (each failure is one line naming the field): world size divisible by
TP x PP and by EP x ETP x PP, EP divides the experts, TP divides the attention heads and KV
heads (TP <= KV heads), the vocabulary splits over TP without padding, PP divides the layers,
every minibatch feeds every data-parallel rank, the engine's GPUs fit beside the trainer's.

Memory per trainer GPU (GiB) in each phase of a step, against the GPU less the trainer's CUDA
context and NCCL buffers (a phase over it is refused, naming the phase; the margin printed is
what the largest phase leaves):
- training: weights, fp32 gradients, optimizer states (unless offloaded), activations at the
  token budget, logits; a colocated engine has released its weights and KV cache;
- weight push: the static state (weights, gradients, optimizer states) and one bucket, beside a
  colocated engine's weights, KV cache at rollout.max_total_tokens and receive buffers (vLLM:
  a fresh buffer per bucket, kept by its layerwise reload: Engine.push_buffer_bytes);
- sync check (weight_sync.check_every > 0): the static state and the forward of one probe of
  prompt + rollout.max_new_tokens tokens, beside the engine;
- rollout: the static state beside the engine (train.py empties the trainer's cache after the
  push and the check, so no cached blocks stay).
Also the engine's KV capacity on its own GPUs, the host memory of an offloaded optimizer (and
whether Megatron's precision-aware optimizer, on the GPU and faster, would fit instead), the disk
a checkpoint and the Hugging Face export take, and the FLOPs of one step. A refused plan still
prints its breakdown.

The estimates are arithmetic on the shapes, not measurements: activations follow
Korthikanti et al. 2022 (sequence parallel, flash attention) adapted to top-k experts;
expect them within ESTIMATE_TOLERANCE (1.5x; launch/smoke_1gpu.sh's memory check holds them to
it). Nothing here has been run on a GPU from this project's machines.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from gspo_mcore.config import Config, ConfigError, load_config
from gspo_mcore.engines import EngineMemory, engine_class, requests_in_flight
from gspo_mcore.errors import run_cli
from gspo_mcore.logprobs import DEFAULT_CHUNK_ELEMENTS
from gspo_mcore.models.qwen3_moe.hf_config import Qwen3MoeArch, load_hf_config
from gspo_mcore.models.qwen3_moe.model import check_layout as check_model_layout
import warnings

GB = 1024**3  # memory in GiB, as torch and nvidia-smi count it
ESTIMATE_TOLERANCE = 1.5  # how far a measured peak may exceed the estimate (the module docstring)
DISK_GB = 1000**3  # disk in GB, as df -H and drive sizes count it
# An H100 80GB HBM3 has 81,559 MiB (nvidia-smi's total), not 80 GiB.
H100_GB = 79.6
# Held by the trainer process beyond what torch allocates: its CUDA context and NCCL's
# communicator buffers. A stated allowance, not a measurement.
TRAINER_CONTEXT_GB = 2.0
PHASES = ("training", "weight push", "sync check", "rollout")
# What lowers each phase's memory, for the refusal message.
PHASE_ADVICE = {
    "training": "lower train.max_tokens_per_microbatch, raise distributed.expert_parallel / pipeline_parallel, "
                "or set model.recompute: full / optimizer.cpu_offload: true",
    "weight push": "lower rollout.max_total_tokens or weight_sync.bucket_mb, raise rollout.engine_tp, "
                   "or set optimizer.cpu_offload: true",
    "sync check": "lower rollout.max_new_tokens (the probe length) or rollout.max_total_tokens, "
                  "set optimizer.cpu_offload: true, or set weight_sync.check_every: 0",
    "rollout": "lower rollout.max_total_tokens, raise rollout.engine_tp, or set optimizer.cpu_offload: true",
}


class MemoryRefused(ConfigError):
    """A layout whose estimate does not fit; carries the plan so the refusal can show it."""
    def __init__(self, message: str, result: dict):
        super().__init__(message)
        self.result = result


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
    check_model_layout(arch, d, trainer)  # the trainer's own check: ranks, heads, vocab, experts, layers, FFN
    dp = trainer // (d.tensor_parallel * d.pipeline_parallel)
    expert_dp = trainer // (d.expert_parallel * d.expert_tensor_parallel * d.pipeline_parallel)
    samples = t.rollout_batch_size * t.group_size
    if samples < t.num_minibatches * dp:
        raise ConfigError(f"train: {t.rollout_batch_size} prompts x {t.group_size} responses = {samples} sequences "
                          f"cannot give each of {t.num_minibatches} minibatches one per data-parallel rank ({dp})")
    return Layout(total, trainer, rollout_gpus, dp, expert_dp)


def _layer_bytes_per_token(config: Config, arch: Qwen3MoeArch) -> float:
    """Bytes (bf16) one layer's forward keeps per token: attention (norm in, qkv, flash output,
    o-proj in) split by TP under sequence parallel; experts: k copies of the token (dispatch)
    and 3 FFN tensors."""
    d, h = config.distributed, arch.hidden_size
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    k, f = arch.num_experts_per_tok, arch.moe_intermediate_size
    return 2 * (4 * h + q + 2 * kv + q) / d.tensor_parallel + 2 * k * (2 * h + 3 * f / d.expert_tensor_parallel)


def activation_bytes(config: Config, arch: Qwen3MoeArch, layout: Layout) -> float:
    d, t = config.distributed, config.train
    tokens = t.max_tokens_per_microbatch
    layer = tokens * _layer_bytes_per_token(config, arch)
    layers_here = arch.num_layers // d.pipeline_parallel
    in_flight = min(d.pipeline_parallel, max(1, t.rollout_batch_size * t.group_size // (t.num_minibatches * layout.dp)))
    if config.model.recompute == "full":  # each layer's input, + the one layer recomputed
        stored = layers_here * tokens * 2 * arch.hidden_size / d.tensor_parallel * in_flight + layer
    else:
        stored = layers_here * layer * in_flight
    # The layer in backward holds its activations' gradients beside them (and the expert
    # all-to-all its send and receive copies): its working set counts twice.
    return stored + layer


def logits_bytes(arch: Qwen3MoeArch, tokens: int, tp: int) -> float:
    """bf16 logits: two [tokens, vocab / TP] copies at a time (GPTModel's [s, b, v] output and
    its contiguous [b, s, v] copy, the first freed once copied: the output layer saves its input,
    not its output; in backward, that copy and its gradient), + gspo_mcore.logprobs' float32 chunk."""
    return arch.vocab_size / tp * tokens * 2 * 2 + DEFAULT_CHUNK_ELEMENTS * 4


def response_tokens(config: Config) -> int:
    """The longest response a sequence carries: one turn, or a multi-turn trajectory's budget
    (its model and environment tokens)."""
    r = config.rollout
    return r.max_new_tokens if r.function == "single_turn" else r.max_trajectory_tokens


def check_forward_bytes(config: Config, arch: Qwen3MoeArch, prompt_tokens: int) -> float:
    """The sync check's trainer forward (weight_sync.check_sync): one probe at a time, of up to
    prompt + max_new_tokens tokens, forward only (one layer's working set at a time) + its logits."""
    probe = prompt_tokens + response_tokens(config)
    return probe * _layer_bytes_per_token(config, arch) + logits_bytes(arch, probe, config.distributed.tensor_parallel)


def trainer_state_bytes(config: Config, arch: Qwen3MoeArch, layout: Layout) -> dict[str, float]:
    """Weights, fp32 gradient buffers and optimizer states on the busiest trainer GPU (the first
    pipeline stage), and the host memory of an offloaded optimizer."""
    d = config.distributed
    counts = param_counts(arch)
    dense_local = counts["dense"] / (d.tensor_parallel * d.pipeline_parallel)
    expert_local = counts["experts"] / (d.expert_parallel * d.expert_tensor_parallel * d.pipeline_parallel)
    weight_bytes = 2 if config.model.dtype == "bfloat16" else 4
    sharded = dense_local + expert_local
    if config.optimizer.distributed_optimizer:
        sharded = dense_local / layout.dp + expert_local / layout.expert_dp
    optimizer = sharded * optimizer_bytes_per_param(config)
    out = {"weights": (dense_local + expert_local) * weight_bytes, "gradients": (dense_local + expert_local) * 4,
           "optimizer": optimizer}
    if config.optimizer.cpu_offload:  # in host memory, not on the GPU
        # + the pinned fp32 copies of this rank's gradient shard that the offloaded step reads
        out["host_optimizer"], out["optimizer"] = optimizer + sharded * 4, 0.0
    return out


def optimizer_bytes_per_param(config: Config) -> int:
    """Optimizer state per parameter it holds: fp32 main weights (bf16 runs) + Adam's two fp32
    moments; optimizer.precision_aware: TE's FusedAdam keeps the master weight as the 16 low
    bits beside the bf16 weight (store_param_remainders, TE >= 2.1) and bf16 moments."""
    if config.optimizer.precision_aware:
        return 2 + 2 + 2
    return (4 if config.model.dtype == "bfloat16" else 0) + 8


def requests_in_flight_estimate(config: Config, prompt_tokens: int) -> dict[str, int]:
    """What the rollout client keeps in flight (gspo_mcore.train: each server's running limit and
    KV room for a full-length request, one slot per server kept free), from the config."""
    r = config.rollout
    request = prompt_tokens + response_tokens(config)
    kv = max(1, r.max_total_tokens // request)
    per_server = min(r.max_running_requests, kv)
    return {"request_tokens": request, "kv_requests_per_server": kv, "requests_per_server": per_server,
            "requests_in_flight": requests_in_flight([per_server] * r.num_servers)}


def check_kv_budget(config: Config, memory: dict) -> None:
    """rollout.max_total_tokens over what an engine GPU beside its weights holds is refused."""
    room = memory.get("engine_kv_cache_tokens")
    if room is not None and config.rollout.max_total_tokens > room:
        raise ConfigError(f"rollout.max_total_tokens {config.rollout.max_total_tokens:,}: more KV cache than an "
                          f"engine GPU holds beside its weights (~{room:,} tokens)")


def engine_memory(config: Config, arch: Qwen3MoeArch) -> EngineMemory:
    """What one GPU of the config's engine holds for this model (the engine's own model)."""
    return engine_class(config.rollout.engine).memory(arch, config.rollout.engine_tp, param_counts(arch)["total"])


def push_buffers_gb(config: Config, layout: Layout) -> float:
    """What an engine GPU holds transiently while it takes a push (Engine.push_buffer_bytes): the
    trainer ranks owning distinct pieces of a layer (pipeline stages x expert shards) send
    interleaved."""
    d = config.distributed
    senders = min(layout.trainer_gpus, d.pipeline_parallel * d.expert_parallel * d.expert_tensor_parallel)
    return engine_class(config.rollout.engine).push_buffer_bytes(config.weight_sync.method,
                                                                  config.weight_sync.bucket_mb << 20, senders) / GB


def memory_estimate(config: Config, arch: Qwen3MoeArch, layout: Layout, prompt_tokens: int = 512) -> dict[str, float]:
    """GiB per trainer GPU (the busiest: first pipeline stage) and per engine GPU."""
    state = trainer_state_bytes(config, arch, layout)
    host = state.pop("host_optimizer", None)
    tokens, tp = config.train.max_tokens_per_microbatch, config.distributed.tensor_parallel
    trainer = {**state, "activations": activation_bytes(config, arch, layout),
               "logits": logits_bytes(arch, tokens, tp)}
    out = {f"trainer_{k}_gb": v / GB for k, v in trainer.items()}
    out["trainer_total_gb"] = sum(trainer.values()) / GB
    out["trainer_static_gb"] = sum(state.values()) / GB
    out["trainer_check_forward_gb"] = check_forward_bytes(config, arch, prompt_tokens) / GB
    if host is not None:
        out["host_optimizer_gb_per_gpu"] = host / GB
    engine = engine_memory(config, arch)
    out["engine_weights_gb"], out["engine_margin_gb"] = engine.weights_gb, engine.margin_gb
    out["engine_push_buffers_gb"] = push_buffers_gb(config, layout)
    out["engine_kv_bytes_per_token"] = engine.kv_bytes_per_token
    if config.weight_sync.colocate:  # what the engine holds on a GPU the trainer shares
        out["engine_kv_cache_gb"] = config.rollout.max_total_tokens * engine.kv_bytes_per_token / GB
        out["engine_resident_gb"] = engine.weights_gb + out["engine_kv_cache_gb"] + engine.margin_gb
    return out


def phase_totals(config: Config, memory: dict[str, float]) -> dict[str, float]:
    """GiB per trainer GPU in each phase of a step (the trainer's CUDA context not included);
    a colocated engine's share is in every phase (only its allowance while released)."""
    static, engine = memory["trainer_static_gb"], memory.get("engine_resident_gb", 0.0)
    released = memory["engine_margin_gb"] if config.weight_sync.colocate else 0.0
    bucket = config.weight_sync.bucket_mb / 1024 * 2  # the flat bucket and its engine-dtype copy
    engine_push = engine + (memory["engine_push_buffers_gb"] if config.weight_sync.colocate else 0.0)
    phases = {"training": memory["trainer_total_gb"] + released, "weight push": static + bucket + engine_push,
              "sync check": static + memory["trainer_check_forward_gb"] + engine, "rollout": static + engine}
    if not config.weight_sync.check_every:
        del phases["sync check"]
    return phases


def check_fits(config: Config, result: dict) -> None:
    """Refuse the first phase over the GPU's usable memory, naming it and what lowers it."""
    for phase, total in result["phases_gb"].items():
        if total > result["usable_gb"]:
            who = ("weight_sync.colocate: during the {} phase the trainer and the engine (weights, KV cache for "
                   f"rollout.max_total_tokens {config.rollout.max_total_tokens}, {result['engine_margin_gb']:g} GiB allowance) need"
                   if config.weight_sync.colocate else "during the {} phase the trainer needs").format(phase)
            raise MemoryRefused(
                f"{who} an estimated {total:.1f} GiB per GPU > {result['usable_gb']:.1f} GiB "
                f"usable (--gpu-memory-gb {result['gpu_memory_gb']:g} less {TRAINER_CONTEXT_GB:g} for the trainer's "
                f"CUDA context): {PHASE_ADVICE[phase]}", result)


def disk_estimate(config: Config, arch: Qwen3MoeArch) -> dict[str, float]:
    """GB on disk: one checkpoint (weights, fp32 master weights of a bf16 run, Adam's two
    moments), how many at once, the Hugging Face export, and what a disk weight sync writes per push."""
    params, t = param_counts(arch)["total"], config.train
    weight_bytes = 2 if config.model.dtype == "bfloat16" else 4
    # Adam's two moments (SGD: Megatron's momentum buffer) + fp32 master weights of a bf16 run;
    # precision-aware: the moments saved unscaled to fp32, the master weights as their 16-bit
    # remainders (DistributedOptimizer._get_main_param_and_optimizer_states, TE's get_unscaled_state)
    state_bytes = (8 if config.optimizer.name == "adam" else 4) + (4 if weight_bytes == 2 else 0)
    if config.optimizer.precision_aware:
        state_bytes = 8 + 2
    # Saves every save_every steps and at the end (train.save_final); the newest keep_checkpoints
    # stay, the oldest removed only once the next is complete.
    saves = ((t.steps - 1) // t.save_every if t.save_every else 0) + int(t.save_final)
    at_once = min(saves, t.keep_checkpoints + 1) if t.keep_checkpoints else saves
    engine_bytes = 2 if config.rollout.engine_dtype == "bfloat16" else 4
    return {"checkpoint_gb": params * (weight_bytes + state_bytes) / DISK_GB, "checkpoints_on_disk": at_once,
            "hf_export_gb": params * weight_bytes / DISK_GB if t.export_hf else 0.0,
            "weight_sync_disk_gb": params * engine_bytes / DISK_GB if config.weight_sync.method == "disk" else 0.0}


def routing_estimate(config: Config, arch: Qwen3MoeArch, layout: Layout, prompt_tokens: int) -> dict[str, float]:
    """The engine's routed experts (rollout.return_routed_experts), at full-length responses:
    what rank 0's host holds (a batch and the requests in flight) and what the busiest trainer
    rank receives per step (its data-parallel share of the batch, its pipeline stage's MoE
    layers: gspo_mcore.routing_delivery). Expert ids travel in the smallest unsigned type."""
    if not config.rollout.return_routed_experts:
        return {}
    t, pp = config.train, config.distributed.pipeline_parallel
    itemsize = 1 if arch.num_experts <= 2**8 else 2
    row = (prompt_tokens + response_tokens(config)) * arch.num_experts_per_tok * itemsize  # one layer of a response
    sequences = t.rollout_batch_size * t.group_size
    held = sequences + requests_in_flight_estimate(config, prompt_tokens)["requests_in_flight"]
    stage_layers = -(-sum(arch.moe_layers) // pp)
    return {"routing_rank0_host_gb": held * row * arch.num_layers / GB,
            "routing_per_rank_gb": -(-sequences // layout.dp) * row * stage_layers / GB}


def flops_per_step(config: Config, arch: Qwen3MoeArch, prompt_tokens: int) -> dict[str, float]:
    """Upper bound at full-length responses: generation 2N per token; training 6N per token
    per epoch (no old-policy forward: GSPO uses the engine's log-probs); attention included."""
    t = config.train
    counts = param_counts(arch)
    sequences = t.rollout_batch_size * t.group_size
    seq_len = prompt_tokens + response_tokens(config)
    attention = 2 * 2 * arch.num_layers * arch.num_attention_heads * arch.head_dim * seq_len / 2  # causal, per token
    generated = sequences * response_tokens(config)  # an upper bound: environment tokens are prefilled
    train_tokens = sequences * seq_len
    generation = generated * (2 * counts["active"] + attention)
    training = t.ppo_epochs * train_tokens * 3 * (2 * counts["active"] + attention)
    if t.recompute_old_logprobs:
        training += train_tokens * (2 * counts["active"] + attention)
    if config.model.recompute == "full":
        training += t.ppo_epochs * train_tokens * (2 * counts["active"] + attention)
    return {"rollout_tflops": generation / 1e12, "train_tflops": training / 1e12,
            "tokens_per_step": train_tokens}


# The code sandbox's own cost per program and per test (bench/sandbox.py: a sandbox started ~55-60
# ms, a test's fork and report 3-10 ms of harness time, on this project's 2-core machine).
SANDBOX_START_S, SANDBOX_TEST_S = 0.06, 0.01
CODE_REWARDS = ("code", "code_all", "gspo_mcore.rewards.code:")


def code_reward_estimate(config: Config) -> dict[str, float]:
    """A code reward's CPU per step (reward.name `code`, `code_all` or gspo_mcore.rewards.code's):
    every response started in a sandbox (once per group when batched) and run on its tests,
    harness time only (trivial programs), and the bound with every test at its CPU limit; the wall
    time at reward.workers sandboxes in parallel. {} for other rewards."""
    name, code = config.reward.name, config.reward.code
    if not (name in CODE_REWARDS[:2] or name.startswith(CODE_REWARDS[2])):
        return {}
    responses = config.train.rollout_batch_size * config.train.group_size * config.rollout.oversample
    tests = code.max_train_tests  # the training cap (code_all runs every test: the count is per problem)
    starts = responses / (config.train.group_size if config.reward.batched else 1)
    harness = starts * SANDBOX_START_S + responses * tests * SANDBOX_TEST_S
    bound = harness + responses * tests * code.cpu_s
    return {"code_reward_core_s": harness, "code_reward_core_s_bound": bound,
            "code_reward_wall_s": harness / config.reward.workers,
            "code_reward_wall_s_bound": bound / config.reward.workers,
            "code_tests_per_s_per_node": config.reward.workers / (SANDBOX_TEST_S + SANDBOX_START_S / tests)}


def plan(config: Config, arch: Qwen3MoeArch, nodes: int, gpus_per_node: int, gpu_memory_gb: float,
         prompt_tokens: int) -> dict:
    """The layout, memory per phase with the margin kept, disk and FLOPs; raises MemoryRefused
    (carrying all of it) when a phase does not fit."""
    if gpu_memory_gb <= TRAINER_CONTEXT_GB:
        raise ConfigError(f"--gpu-memory-gb {gpu_memory_gb:g}: must exceed the trainer's {TRAINER_CONTEXT_GB:g} GiB "
                          "CUDA context")
    engine_class(config.rollout.engine).check_config(config)
    layout = check_layout(config, arch, nodes, gpus_per_node)
    memory = memory_estimate(config, arch, layout, prompt_tokens)
    phases = phase_totals(config, memory)
    usable = gpu_memory_gb - TRAINER_CONTEXT_GB
    tightest = max(phases, key=phases.get)
    if layout.rollout_gpus:
        # The push's receive buffers come out of the room the KV cache would take.
        free = (gpu_memory_gb * engine_memory(config, arch).usable_fraction - memory["engine_weights_gb"]
                - memory["engine_push_buffers_gb"])
        if free <= 0:
            raise ConfigError(f"rollout.engine_tp {config.rollout.engine_tp}: {config.rollout.engine}'s weights alone "
                              f"({memory['engine_weights_gb']:.1f} GiB) do not fit a {gpu_memory_gb:g} GiB GPU")
        memory["engine_kv_cache_tokens"] = int(free * GB / memory["engine_kv_bytes_per_token"])
        check_kv_budget(config, memory)
    counts = param_counts(arch)
    memory.update(requests_in_flight_estimate(config, prompt_tokens))
    result = {"gpus": layout.total_gpus, "trainer_gpus": layout.trainer_gpus, "rollout_gpus": layout.rollout_gpus,
              "data_parallel": layout.dp, "expert_data_parallel": layout.expert_dp,
              "params_total_b": counts["total"] / 1e9, "params_active_b": counts["active"] / 1e9,
              **memory, "estimate_tolerance": ESTIMATE_TOLERANCE, "gpu_memory_gb": gpu_memory_gb, "usable_gb": usable, "phases_gb": phases,
              "tightest_phase": tightest, "margin_gb": usable - phases[tightest],
              **disk_estimate(config, arch), **flops_per_step(config, arch, prompt_tokens),
              **routing_estimate(config, arch, layout, prompt_tokens), **code_reward_estimate(config)}
    if config.optimizer.cpu_offload:
        result.update(precision_aware_alternative(config, arch, layout, usable, prompt_tokens))
    check_fits(config, result)
    return result


# Megatron-Bridge's measurement of an offloaded optimizer's step time against the optimizer on
# the GPU, for Qwen3-30B-A3B (quoted by issue #37; not measured here: launch/gpu_check.py's
# section 3 prints this machine's own ratio at 2 layers).
OFFLOAD_STEP_TIME = "1.9-4.2x"


def precision_aware_alternative(config: Config, arch: Qwen3MoeArch, layout: Layout, usable: float,
                                prompt_tokens: int) -> dict:
    """An offloading config's plan with the precision-aware optimizer on the GPU instead: its
    optimizer GiB per GPU and the margin at its tightest phase (negative: does not fit); {} when
    the config cannot take it (optimizer.precision_aware's own conditions)."""
    optimizer = dataclasses.replace(config.optimizer, cpu_offload=False, precision_aware=True)
    try:
        alternative = dataclasses.replace(config, optimizer=optimizer).validate()
    except ConfigError:
        return {}
    memory = memory_estimate(alternative, arch, layout, prompt_tokens)
    phases = phase_totals(alternative, memory)
    tightest = max(phases, key=phases.get)
    return {"precision_aware_optimizer_gb": memory["trainer_optimizer_gb"],
            "precision_aware_tightest_phase": tightest, "precision_aware_margin_gb": usable - phases[tightest]}


def report(config: Config, result: dict, out) -> None:
    """The plan for a person: layout, memory by phase with the margin, disk, FLOPs."""
    d, r, w = config.distributed, result, (lambda line: print(line, file=out))
    w(f"{r['gpus']} GPUs: {r['trainer_gpus']} trainer (TP {d.tensor_parallel} x PP {d.pipeline_parallel}"
      f" x DP {r['data_parallel']}; experts EP {d.expert_parallel} x ETP {d.expert_tensor_parallel} x "
      f"expert-DP {r['expert_data_parallel']}), "
      + (f"{config.rollout.engine} on the same GPUs (colocated)" if config.weight_sync.colocate
         else f"{r['rollout_gpus']} {config.rollout.engine}"))
    w(f"model: {r['params_total_b']:.1f}B parameters, {r['params_active_b']:.2f}B active per token")
    w("per trainer GPU while training (GiB): " + ", ".join(
        f"{k} {r[f'trainer_{k}_gb']:.1f}" for k in ("weights", "gradients", "optimizer", "activations", "logits"))
      + f"; sync-check forward {r['trainer_check_forward_gb']:.1f}")
    if "host_optimizer_gb_per_gpu" in r:
        w(f"host memory: {r['host_optimizer_gb_per_gpu']:.1f} GiB per trainer GPU (offloaded Adam + fp32 gradient "
          f"copies)")
    if "engine_resident_gb" in r:
        w(f"{config.rollout.engine} beside it (GiB): weights {r['engine_weights_gb']:.1f}, KV cache {r['engine_kv_cache_gb']:.1f} "
          f"(rollout.max_total_tokens {config.rollout.max_total_tokens}), allowance {r['engine_margin_gb']:g}")
    w(f"per GPU by phase (GiB of {r['usable_gb']:.1f} usable: {r['gpu_memory_gb']:g} less {TRAINER_CONTEXT_GB:g} for "
      "the trainer's CUDA context and NCCL buffers): "
      + ", ".join(f"{phase} {total:.1f}" for phase, total in r["phases_gb"].items()))
    w(f"margin: {r['margin_gb']:.1f} GiB per GPU at the {r['tightest_phase']} phase"
      + (" (REFUSED)" if r["margin_gb"] < 0 else ""))
    if r["rollout_gpus"]:
        w(f"per {config.rollout.engine} GPU: weights {r['engine_weights_gb']:.1f} GiB, push receive buffers "
          f"{r['engine_push_buffers_gb']:.1f} GiB, KV cache for ~{r['engine_kv_cache_tokens']:,} tokens")
    w(f"in flight: up to {r['requests_in_flight']} requests ({config.rollout.num_servers} server(s) x "
      f"{r['requests_per_server']}: rollout.max_running_requests {config.rollout.max_running_requests}, KV room "
      f"(rollout.max_total_tokens {config.rollout.max_total_tokens:,}) for {r['kv_requests_per_server']} of "
      f"{r['request_tokens']:,} tokens; one per server kept for the sync check)")
    if "routing_per_rank_gb" in r:
        w(f"routed experts (rollout.return_routed_experts): up to {r['routing_rank0_host_gb']:.1f} GiB on rank 0's "
          f"host (a batch and the requests in flight), {r['routing_per_rank_gb']:.2f} GiB a step to the busiest "
          "trainer rank (its rollouts, its stage's layers)")
    t = config.train
    w(f"disk warning: each checkpoint ~{r['checkpoint_gb']:,.0f} GB (weights + fp32 master weights + 2 Adam "
      f"moments), written {f'every {t.save_every} steps and ' if t.save_every else ''}at the end, up to "
      f"{r['checkpoints_on_disk']} at once (train.keep_checkpoints {t.keep_checkpoints}): "
      f"~{r['checkpoint_gb'] * r['checkpoints_on_disk']:,.0f} GB"
      + (f"; Hugging Face export ~{r['hf_export_gb']:,.0f} GB (train.export_hf)" if r["hf_export_gb"] else "")
      + (f"; each weight push writes ~{r['weight_sync_disk_gb']:,.0f} GB (weight_sync.method disk)"
         if r["weight_sync_disk_gb"] else ""))
    if r.get("precision_aware_margin_gb", -1.0) >= 0:
        w("faster where it fits: optimizer.precision_aware: true, optimizer.cpu_offload: false fits (bf16 Adam "
          f"moments on the GPU, {r['precision_aware_optimizer_gb']:.1f} GiB per GPU; margin "
          f"{r['precision_aware_margin_gb']:.1f} GiB at the {r['precision_aware_tightest_phase']} phase): "
          "Megatron-Bridge measures CPU offload at "
          f"{OFFLOAD_STEP_TIME} the step time on Qwen3-30B-A3B")
    if "code_reward_core_s" in r:
        w(f"code reward (reward.name {config.reward.name}): ~{r['code_reward_core_s']:,.0f} CPU-s of sandbox a step "
          f"(harness only, up to {config.reward.code.max_train_tests} tests a response; every test at "
          f"reward.code.cpu_s: {r['code_reward_core_s_bound']:,.0f}), ~{r['code_reward_wall_s']:,.1f} s wall at "
          f"reward.workers {config.reward.workers} (bound {r['code_reward_wall_s_bound']:,.0f} s); "
          f"~{r['code_tests_per_s_per_node']:,.0f} trivial tests/s per node")
    w(f"one step (upper bound, full-length responses): rollout {r['rollout_tflops']:.0f} TFLOP, "
      f"train {r['train_tflops']:.0f} TFLOP")


def shell_lines(config: Config, result: dict) -> list[str]:
    """KEY=value lines the launch scripts eval."""
    r = config.rollout
    values = (("ENGINE", r.engine), ("TRAINER_GPUS", result["trainer_gpus"]), ("ROLLOUT_GPUS", result["rollout_gpus"]),
              ("NUM_SERVERS", r.num_servers), ("ENGINE_TP", r.engine_tp),
              ("COLOCATE", int(config.weight_sync.colocate)), ("EXTERNAL_SERVERS", int(bool(r.urls))))
    return [f"GSPO_{key}={value}" for key, value in values]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gspo_mcore.plan", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--hf-config", help="the model's config.json (default: model.hf_dir/config.json)")
    parser.add_argument("--gpu-memory-gb", type=float, default=H100_GB, help="GiB per GPU (default: an H100's)")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="prompt length for the FLOPs bound and the probes")
    parser.add_argument("--shell", action="store_true",
                        help="print KEY=value lines for the launch scripts (the plan goes to stderr)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args(argv)

    warnings.filterwarnings("ignore", module="megatron")  # "Apex / TE not installed" on planning machines
    config = load_config(args.config, args.overrides)
    if args.nodes < 1 or args.gpus_per_node < 1:
        raise ConfigError("--nodes and --gpus-per-node must be >= 1")
    hf_config = Path(args.hf_config or Path(config.model.hf_dir) / "config.json")
    if not args.hf_config and not hf_config.is_file():  # planning comes before the download
        raise ConfigError(f"model.hf_dir: {hf_config} not found; without the weights on disk give the model's "
                          "config.json: --hf-config configs/hf/<model>.config.json")
    arch = load_hf_config(hf_config)
    out = sys.stderr if args.shell else sys.stdout  # --shell: stdout is eval'd
    try:
        result = plan(config, arch, args.nodes, args.gpus_per_node, args.gpu_memory_gb, args.prompt_tokens)
    except MemoryRefused as refused:  # the breakdown shows why, then the one-line error
        report(config, refused.result, out)
        raise
    report(config, result, out)
    print("\n".join(shell_lines(config, result)) if args.shell else json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
