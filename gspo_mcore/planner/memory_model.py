"""The planner's memory model: a run's GPU layout checked, and the memory per trainer GPU in each
phase of a step and per engine GPU, estimated from the config and the model's shapes (arithmetic,
not measurement: activations after Korthikanti et al. 2022, sequence parallel and fused attention,
adapted to top-k experts; expected within ESTIMATE_TOLERANCE of a measured peak). The Trainer
reports its measured peak beside `memory_estimate`; `python -m gspo_mcore.planner.cli` prints it all.

What the training estimate holds (`training_bytes`): activations and logits in model.dtype (2 bytes
a value in bfloat16, 4 in float32); the logits and a layer's backward peak at different moments
(the logits are freed once the output layer's backward is done, before any layer's), so the
larger of the two counts, not their sum; the busiest expert rank's routed tokens at
EXPERT_IMBALANCE times the mean. Attention is fused (flash / cuDNN / memory-efficient: O(s) memory
per layer): the `te` spec's, and `spec: local`'s torch SDPA on CUDA; an unfused O(s^2) attention
([b x heads, s, s] scores and their softmax) has no term here."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from gspo_mcore.config import Config, ConfigError
from gspo_mcore.engines import EngineMemory, engine_class, requests_in_flight
from gspo_mcore.gspo.logprobs import DEFAULT_CHUNK_ELEMENTS
from gspo_mcore.megatron.qwen3_moe.hf_config import Qwen3MoeArch
from gspo_mcore.megatron.step_chunks import STEP_CHUNK_PARAMS
from gspo_mcore.megatron.qwen3_moe.model import check_layout as check_model_layout

GB = 1024**3  # memory in GiB, as torch and nvidia-smi count it
ESTIMATE_TOLERANCE = 1.5  # how far a measured peak may exceed the estimate
# An H100 80GB HBM3 has 81,559 MiB (nvidia-smi's total), not 80 GiB.
H100_GB = 79.6
# Held by the trainer process beyond what torch allocates: its CUDA context and NCCL's
# communicator buffers. A stated allowance, not a measurement.
TRAINER_CONTEXT_GB = 2.0
# The busiest expert rank's routed tokens over the mean. Megatron's router here is dropless (no
# capacity factor) and GSPO adds no load-balancing loss (model.moe_aux_loss_coeff 0): a rank
# receives what the pretrained router sends it, up to ~2x the mean on a microbatch (issue #45's
# reading). A stated bound, not a measurement; `expert_imbalance` caps it by what a rank can receive.
EXPERT_IMBALANCE = 2.0
# What a colocated config keeps free at its tightest phase when its KV room is the planner's
# (`kv_room_tokens`): ~10% of an H100, for the estimate's own error and the caching allocator's
# fragmentation (torch reserves more than it allocates). Split engines keep theirs in USABLE_FRACTION.
KV_ROOM_MARGIN_GB = 8.0
KV_ROOM_GRANULE_TOKENS = 1024  # the KV room rounded down to this: a figure a config can carry
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


def value_bytes(config: Config) -> int:
    """Bytes of one activation or logit: model.dtype's (Megatron computes in params_dtype)."""
    return 2 if config.model.dtype == "bfloat16" else 4


def expert_imbalance(config: Config, arch: Qwen3MoeArch) -> float:
    """The busiest expert rank's routed copies over the mean (EXPERT_IMBALANCE), capped by what one
    rank can receive: a token sends it at most min(k, experts on the rank) of its k copies, so
    the cap is that over the mean k / EP (EP 1: every copy, so 1)."""
    ep, k = config.distributed.expert_parallel, arch.num_experts_per_tok
    return min(EXPERT_IMBALANCE, min(k, arch.num_experts // ep) * ep / k)


def _layer_bytes_per_token(config: Config, arch: Qwen3MoeArch) -> float:
    """Bytes one layer's forward keeps per token of the microbatch, in model.dtype: attention (norm
    in, qkv, fused attention's output, o-proj in) split by TP under sequence parallel; experts: for
    each of the k routed copies, one at the sending rank (dispatch) and, at the expert rank, the
    received token and 3 FFN tensors, at the busiest expert rank's share (`expert_imbalance`), of
    the rank's 1/TP of the tokens (sequence parallel)."""
    d, h = config.distributed, arch.hidden_size
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    k, f = arch.num_experts_per_tok, arch.moe_intermediate_size
    attention = (4 * h + q + 2 * kv + q) / d.tensor_parallel
    # Sequence parallel (on with TP > 1) hands each rank's router its 1/TP of the tokens: the
    # dispatcher sends those (the rehearsal measured the 235B config's TP 4 layers at a quarter).
    experts = k * (h + expert_imbalance(config, arch) * (h + 3 * f / d.expert_tensor_parallel)) / d.tensor_parallel
    return value_bytes(config) * (attention + experts)


def activation_bytes(config: Config, arch: Qwen3MoeArch, layout: Layout) -> dict[str, float]:
    """Activations of the busiest GPU: `stored`, kept through the pass (model.recompute full: each
    layer's input; none: every layer's activations), for each microbatch in flight; `layer`, what
    the layer in backward adds: its activations' gradients beside them (and the expert all-to-all
    its send and receive copies), with full recompute its recomputed activations too."""
    d, t = config.distributed, config.train
    tokens = t.max_tokens_per_microbatch
    layer = tokens * _layer_bytes_per_token(config, arch)
    layers_here = arch.num_layers // d.pipeline_parallel
    in_flight = min(d.pipeline_parallel, max(1, t.rollout_batch_size * t.group_size // (t.num_minibatches * layout.dp)))
    if config.model.recompute == "full":
        layer_input = tokens * value_bytes(config) * arch.hidden_size / d.tensor_parallel
        return {"stored": layers_here * layer_input * in_flight, "layer": 2 * layer}
    return {"stored": layers_here * layer * in_flight, "layer": layer}


def logits_bytes(arch: Qwen3MoeArch, tokens: int, tp: int, value_bytes: int = 2) -> float:
    """Logits in model.dtype: two [tokens, vocab / TP] copies at a time (GPTModel's [s, b, v]
    output and its contiguous [b, s, v] copy, the first freed once copied: the output layer saves
    its input, not its output; in backward, that copy and its gradient), + gspo_mcore.gspo.logprobs'
    float32 chunk."""
    return arch.vocab_size / tp * tokens * value_bytes * 2 + DEFAULT_CHUNK_ELEMENTS * 4


# gspo_mcore.gspo.logprobs._FusedLinearLogprobs: a block's logits in the weight's dtype, their
# float32 copy, its exp and shifted temporaries, the gradient block: ~22 bytes a logit of a block
FUSED_BYTES_PER_BLOCK_LOGIT = 22


def fused_logits_bytes(arch: Qwen3MoeArch, tokens: int, tp: int, value_bytes: int = 2, backward: bool = True) -> float:
    """model.fused_logprobs' in place of `logits_bytes`: one block of the vocabulary's logits and
    temporaries (DEFAULT_CHUNK_ELEMENTS logits) and, in backward, the hidden states' float32
    gradient (summed over the blocks) and the output weight's gradient [V / TP, h]; the hidden
    states it saves are the last layer's output, counted with the activations."""
    block = DEFAULT_CHUNK_ELEMENTS * FUSED_BYTES_PER_BLOCK_LOGIT
    if not backward:
        return block
    return block + tokens * arch.hidden_size * 4 + arch.vocab_size / tp * arch.hidden_size * value_bytes


def output_bytes(config: Config, arch: Qwen3MoeArch, tokens: int, backward: bool = True) -> float:
    """The output layer's and the log-probs' memory for `tokens` tokens: the logits, or with
    model.fused_logprobs a block of them."""
    tp = config.distributed.tensor_parallel
    if config.model.fused_logprobs:
        return fused_logits_bytes(arch, tokens, tp, value_bytes(config), backward)
    return logits_bytes(arch, tokens, tp, value_bytes(config))


def training_bytes(config: Config, arch: Qwen3MoeArch, layout: Layout) -> dict:
    """The training pass beyond the static state, at its two peaks: the logits' (the stored
    activations and the logits, after the last layer's forward) and a layer's backward (the stored
    activations and that layer's working set; the logits and their gradient are freed once the
    output layer's backward is done). `peak` is the larger, not the sum."""
    activations = activation_bytes(config, arch, layout)
    logits = output_bytes(config, arch, config.train.max_tokens_per_microbatch)
    at_logits, at_layer = activations["stored"] + logits, activations["stored"] + activations["layer"]
    step = optimizer_step_bytes(config, arch, layout)  # after the last backward: the activations are gone
    peaks = {"logits": at_logits, "layer backward": at_layer, "optimizer step": step}
    peak_at = max(peaks, key=peaks.get)
    return {"activations": at_layer, "stored_activations": activations["stored"], "logits": logits,
            "optimizer_step": step, "peak": peaks[peak_at], "peak_at": peak_at}


def optimizer_step_bytes(config: Config, arch: Qwen3MoeArch, layout: Layout) -> float:
    """What the optimizer's step allocates on the GPU while it runs, for the optimizer built:
    - torch's Adam / SGD (GPU Adam): nothing; gspo_mcore.megatron.optimizer.fuse_torch_steps asks
      for the fused step (megatron-core would leave torch's foreach path, whose `_foreach_sqrt` is
      an fp32 copy of a whole param group: 4 bytes a parameter of the largest, measured on CPU);
    - an offloaded optimizer (HybridDeviceOptimizer): its step runs on the host;
    - the precision-aware optimizer (Transformer Engine's FusedAdam with bf16 moments): an fp32
      copy of both moments of every parameter of the group it steps, kept until the group's kernel
      ran (transformer_engine/pytorch/optimizers/fused_adam.py `step`: `get_unscaled_state` ->
      `unscaled_lists`, scaled back after the group; read from TE's source, not measured here): 8
      bytes a parameter of the largest group, which the trainer steps in chunks of
      STEP_CHUNK_PARAMS (gspo_mcore.megatron.step_chunks). Megatron's groups
      split dense from expert parameters (a chained optimizer each, stepped one after the other),
      decay from no decay."""
    if config.optimizer.cpu_offload or not config.optimizer.precision_aware:
        return 0.0
    dense, experts = _local_params(config, arch)
    if config.optimizer.distributed_optimizer:
        dense, experts = dense / layout.dp, experts / layout.expert_dp
    return 8 * min(max(dense, experts), STEP_CHUNK_PARAMS)


def response_tokens(config: Config) -> int:
    """The longest response a sequence carries: one turn, or a multi-turn trajectory's budget
    (its model and environment tokens)."""
    r = config.rollout
    return r.max_new_tokens if r.function == "single_turn" else r.max_trajectory_tokens


def check_forward_bytes(config: Config, arch: Qwen3MoeArch, prompt_tokens: int) -> float:
    """The sync check's trainer forward (weight_sync.check_sync): one probe at a time, of up to
    prompt + max_new_tokens tokens, forward only: its hidden states and the larger of one layer's
    working set and its logits (the layers' are freed before the logits are made)."""
    probe = prompt_tokens + response_tokens(config)
    layer = probe * _layer_bytes_per_token(config, arch)
    logits = output_bytes(config, arch, probe, backward=False)
    return probe * arch.hidden_size * value_bytes(config) + max(layer, logits)


def trainer_state_bytes(config: Config, arch: Qwen3MoeArch, layout: Layout) -> dict[str, float]:
    """Weights, fp32 gradient buffers and optimizer states on the busiest trainer GPU (the first
    pipeline stage), and the host memory of an offloaded optimizer."""
    local, sharded = local_params(config, arch), optimizer_params_per_gpu(config, arch, layout)
    weight_bytes = 2 if config.model.dtype == "bfloat16" else 4
    optimizer = sharded * optimizer_bytes_per_param(config)
    out = {"weights": local * weight_bytes, "gradients": local * 4, "optimizer": optimizer}
    if config.optimizer.cpu_offload:  # in host memory, not on the GPU
        # + the pinned fp32 copies of this rank's gradient shard that the offloaded step reads
        out["host_optimizer"], out["optimizer"] = optimizer + sharded * 4, 0.0
    return out


def _local_params(config: Config, arch: Qwen3MoeArch) -> tuple[float, float]:
    """(dense, expert) parameters on the busiest trainer GPU (the first pipeline stage)."""
    d, counts = config.distributed, param_counts(arch)
    return (counts["dense"] / (d.tensor_parallel * d.pipeline_parallel),
            counts["experts"] / (d.expert_parallel * d.expert_tensor_parallel * d.pipeline_parallel))


def local_params(config: Config, arch: Qwen3MoeArch) -> float:
    """Parameters a trainer GPU holds (weights and gradients)."""
    return sum(_local_params(config, arch))


def optimizer_params_per_gpu(config: Config, arch: Qwen3MoeArch, layout: Layout) -> float:
    """Parameters a trainer GPU's optimizer steps: its own, or with the distributed optimizer its
    data-parallel shard of them (dense over DP, experts over expert-DP). An offloaded optimizer
    steps these on the host (gspo_mcore.planner.host_adam)."""
    dense, experts = _local_params(config, arch)
    if config.optimizer.distributed_optimizer:
        return dense / layout.dp + experts / layout.expert_dp
    return dense + experts


def optimizer_bytes_per_param(config: Config) -> int:
    """Optimizer state per parameter it holds: fp32 main weights (bf16 runs) + Adam's two fp32
    moments (SGD: one momentum, megatron-core's sgd_momentum 0.9); optimizer.precision_aware: TE's
    FusedAdam keeps the master weight as the 16 low bits beside the bf16 weight
    (store_param_remainders, TE >= 2.1: gspo_mcore.megatron.optimizer refuses older) and bf16
    moments. The fp32 gradients are apart (`trainer_state_bytes`)."""
    if config.optimizer.precision_aware:
        return 2 + 2 + 2
    return (4 if config.model.dtype == "bfloat16" else 0) + (8 if config.optimizer.name == "adam" else 4)


def requests_in_flight_estimate(config: Config, prompt_tokens: int) -> dict[str, int]:
    """What the rollout client keeps in flight (gspo_mcore.run.trainer: each server's running limit and
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


def engine_kv_room_gb(config: Config, arch: Qwen3MoeArch, gpu_memory_gb: float, push_buffers_gb: float) -> float:
    """What an engine GPU gives its KV cache when it has the GPU: its usable share, less its weights
    and the push's receive buffers (the room the KV cache would take)."""
    engine = engine_memory(config, arch)
    return gpu_memory_gb * engine.usable_fraction - engine.weights_gb - push_buffers_gb


def push_buffers_gb(config: Config, layout: Layout) -> float:
    """What an engine GPU holds transiently while it takes a push (Engine.push_buffer_bytes): the
    trainer ranks owning distinct pieces of a layer (pipeline stages x expert shards) send
    interleaved."""
    d = config.distributed
    senders = min(layout.trainer_gpus, d.pipeline_parallel * d.expert_parallel * d.expert_tensor_parallel)
    return engine_class(config.rollout.engine).push_buffer_bytes(config.weight_sync.method,
                                                                  config.weight_sync.bucket_mb << 20, senders) / GB


def memory_estimate(config: Config, arch: Qwen3MoeArch, layout: Layout, prompt_tokens: int = 512) -> dict:
    """GiB per trainer GPU (the busiest: first pipeline stage) and per engine GPU; `trainer_peak_at`
    names the training peak's moment."""
    state = trainer_state_bytes(config, arch, layout)
    host = state.pop("host_optimizer", None)
    training = training_bytes(config, arch, layout)
    out = {f"trainer_{k}_gb": v / GB for k, v in state.items()}
    for key in ("activations", "stored_activations", "logits", "optimizer_step"):
        out[f"trainer_{key}_gb"] = training[key] / GB
    out["trainer_total_gb"] = (sum(state.values()) + training["peak"]) / GB
    out["trainer_peak_at"] = training["peak_at"]
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
    if config.optimizer.offload_grad_buffers:  # given back from the update's end to the next one's start
        static -= memory["trainer_gradients_gb"]
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


def precision_aware_alternative(config: Config, arch: Qwen3MoeArch, layout: Layout, gpu_memory_gb: float,
                                prompt_tokens: int) -> dict:
    """An offloading config's plan with the precision-aware optimizer on the GPU instead, its KV
    cache at that plan's own KV room (`kv_room_tokens`: colocated, the optimizer's GPU memory comes
    out of it): its optimizer GiB per GPU, that KV room, the margin at its tightest phase, and
    whether it fits (no phase over the GPU, room for a full-length request a server); {} when the
    config cannot take it (optimizer.precision_aware's own conditions)."""
    optimizer = dataclasses.replace(config.optimizer, cpu_offload=False, precision_aware=True,
                                    offload_grad_buffers=config.weight_sync.colocate)
    try:
        alternative = dataclasses.replace(config, optimizer=optimizer).validate()
    except ConfigError:
        return {}
    room = kv_room_tokens(alternative, arch, layout, gpu_memory_gb, prompt_tokens)
    if config.weight_sync.colocate:
        alternative = dataclasses.replace(alternative, rollout=dataclasses.replace(alternative.rollout,
                                                                                   max_total_tokens=room))
    memory = memory_estimate(alternative, arch, layout, prompt_tokens)
    phases = phase_totals(alternative, memory)
    tightest = max(phases, key=phases.get)
    margin = gpu_memory_gb - TRAINER_CONTEXT_GB - phases[tightest]
    request = prompt_tokens + response_tokens(config)
    return {"precision_aware_optimizer_gb": memory["trainer_optimizer_gb"], "precision_aware_kv_room_tokens": room,
            "precision_aware_tightest_phase": tightest, "precision_aware_margin_gb": margin,
            "precision_aware_fits": margin >= 0 and room >= request}


def kv_room_tokens(config: Config, arch: Qwen3MoeArch, layout: Layout, gpu_memory_gb: float = H100_GB,
                   prompt_tokens: int = 512) -> int:
    """The largest rollout.max_total_tokens (the KV cache per engine server: SGLang's
    --max-total-tokens, vLLM's --kv-cache-memory-bytes) the planner keeps room for, rounded down to
    KV_ROOM_GRANULE_TOKENS: what an engine GPU gives its KV cache (`engine_kv_room_gb`) and,
    colocated, what leaves KV_ROOM_MARGIN_GB free in every phase the KV cache is resident (all but
    training, when the engine has released it). The shipped configs carry this figure
    (tests/test_plan.py holds them to it)."""
    room_gb = engine_kv_room_gb(config, arch, gpu_memory_gb, push_buffers_gb(config, layout))
    without = dataclasses.replace(config, rollout=dataclasses.replace(config.rollout, max_total_tokens=0))
    memory = memory_estimate(without, arch, layout, prompt_tokens)
    if config.weight_sync.colocate:
        resident = {phase: total for phase, total in phase_totals(without, memory).items() if phase != "training"}
        room_gb = min(room_gb, gpu_memory_gb - TRAINER_CONTEXT_GB - KV_ROOM_MARGIN_GB - max(resident.values()))
    tokens = int(max(0.0, room_gb) * GB / memory["engine_kv_bytes_per_token"])
    return tokens // KV_ROOM_GRANULE_TOKENS * KV_ROOM_GRANULE_TOKENS
