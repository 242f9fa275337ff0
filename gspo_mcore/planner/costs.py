"""The planner's other costs of a step: the disk checkpoints and exports take, the routed experts'
memory, the FLOPs of every pass the step makes, and a code reward's sandbox CPU."""

from __future__ import annotations

from gspo_mcore.config import Config
from gspo_mcore.megatron.qwen3_moe.hf_config import Qwen3MoeArch
from gspo_mcore.planner.flops import forward_flops, update_flops
from gspo_mcore.planner.memory_model import GB, Layout, param_counts, requests_in_flight_estimate, response_tokens

DISK_GB = 1000**3  # disk in GB, as df -H and drive sizes count it
# What a save on preemption has: Slurm's time-limit warning comes 600 s before the end
# (--signal=B:USR1@600, launch/slurm/*.sbatch) and torchrun waits GSPO_SAVE_TIMEOUT_S (default 540 s,
# gspo_mcore.run.torchrun) for the trainer to finish its update and save before it kills it.
PREEMPTION_WINDOW_S = 540
# A node's checkpoint write rate, all its ranks together (GB/s), stated: the first H100 contact's
# save (launch/gpu_check.py section 4) wrote 26 GB (1.87B parameters x 14 bytes) from one process
# in 27.4 s, ~0.95 GB/s to that machine's disk. A parallel file system may give a node more, NFS
# less: measure yours and pass --checkpoint-write-gb-s.
CHECKPOINT_WRITE_GB_S = 1.0


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


def checkpoint_save_estimate(checkpoint_gb: float, trainer_gpus: int, gpus_per_node: int,
                             write_gb_s: float = CHECKPOINT_WRITE_GB_S) -> dict[str, float]:
    """A checkpoint's save time: each trainer rank writes its share (its model and optimizer
    state; Megatron's dist_checkpointing writes a replicated tensor from one replica, ~1% of a
    30B checkpoint in dense weights, counted here as spread), so a trainer node writes the
    checkpoint over the trainer's nodes, at `write_gb_s` a node."""
    node_gb = checkpoint_gb / -(-trainer_gpus // gpus_per_node)
    return {"checkpoint_node_gb": node_gb, "checkpoint_write_gb_s": write_gb_s,
            "checkpoint_save_s": node_gb / write_gb_s, "preemption_window_s": PREEMPTION_WINDOW_S}


def routing_estimate(config: Config, arch: Qwen3MoeArch, layout: Layout, prompt_tokens: int) -> dict[str, float]:
    """The engine's routed experts (rollout.return_routed_experts), at full-length responses:
    what rank 0's host holds (a batch and the requests in flight) and what the busiest trainer
    rank receives per step (its data-parallel share of the batch, its pipeline stage's MoE
    layers: gspo_mcore.megatron.routing_delivery). Expert ids travel in the smallest unsigned type."""
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


def forward_passes(config: Config) -> dict[str, int]:
    """The forward-only passes over the whole batch a step makes besides its update, by what they
    are for (gspo_mcore.run.trainer's `_update`, gspo_mcore.megatron.learner's `update`): pi_prox in the
    asynchronous modes (loss.proximal recompute) or pi_old in sync (train.recompute_old_logprobs);
    strict exactness's forward at theta_old where neither already made one (Config.strict); the
    frozen reference's (loss.kl_loss_coef > 0)."""
    passes = {}
    if config.rollout.mode != "sync" and config.loss.proximal == "recompute":
        passes["proximal"] = 1
    elif config.rollout.mode == "sync" and config.train.recompute_old_logprobs:
        passes["old_logprobs"] = 1
    elif config.strict:
        passes["strict_exactness"] = 1
    if config.loss.kl_loss_coef > 0:
        passes["reference"] = 1
    return passes


def flops_per_step(config: Config, arch: Qwen3MoeArch, prompt_tokens: int) -> dict[str, float]:
    """Upper bound at full-length responses (gspo_mcore.planner.flops): generation one forward a
    token; the update's model FLOPs (6N + attention a token an epoch) and hardware FLOPs (+ the
    recomputed forwards, + each forward of `forward_passes`). `train_tflops` is the hardware count,
    every pass the step makes; `*_flops_per_token` per token of the batch."""
    t = config.train
    sequences = t.rollout_batch_size * t.group_size
    seq_len = prompt_tokens + response_tokens(config)
    forward = forward_flops(arch, [seq_len])  # per token at seq_len: 2N + causal attention
    generated = sequences * response_tokens(config)  # an upper bound: environment tokens are prefilled
    train_tokens = sequences * seq_len
    passes = forward_passes(config)
    training = update_flops(config, arch, [seq_len], sum(passes.values()))  # one sequence: x sequences
    return {"rollout_tflops": generated * (forward["layers"] + forward["output"]) / seq_len / 1e12,
            "train_tflops": sequences * training.hardware / 1e12,
            "train_model_tflops": sequences * training.model / 1e12,
            "model_flops_per_token": training.model / seq_len, "hardware_flops_per_token": training.hardware / seq_len,
            "tokens_per_step": train_tokens, "train_forward_passes": passes}


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
