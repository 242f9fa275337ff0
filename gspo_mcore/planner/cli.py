"""Check a run's GPU layout before any GPU is touched, and estimate memory, disk and FLOPs.

    python -m gspo_mcore.planner.cli --config X [--nodes N] [--gpus-per-node 8] [--hf-config config.json]
                              [--gpu-memory-gb 79.6] [--prompt-tokens 512] [--host-cores-per-gpu N]
                              [--host-adam FILE.json] [--checkpoint-write-gb-s 1.0] [--shell] [key=value ...]

Layout checks (each failure is one line naming the field): world size divisible by
TP x PP and by EP x ETP x PP, EP divides the experts, TP divides the attention heads and KV
heads (TP <= KV heads), the vocabulary splits over TP without padding, PP divides the layers,
every minibatch feeds every data-parallel rank, the engine's GPUs fit beside the trainer's.

Memory per trainer GPU (GiB) in each phase of a step, against the GPU less the trainer's CUDA
context and NCCL buffers (a phase over it is refused, naming the phase; the margin printed is
what the largest phase leaves):
- training: weights, fp32 gradients, optimizer states (unless offloaded), and the larger of the
  pass's two peaks: the logits (with the stored activations) and a layer's backward (the stored
  activations, the layer's own and their gradients, the busiest expert rank's tokens); activations
  and logits in model.dtype; a colocated engine has released its weights and KV cache;
- weight push: the static state (weights, gradients, optimizer states) and one bucket, beside a
  colocated engine's weights, KV cache at rollout.max_total_tokens and receive buffers (vLLM:
  a fresh buffer per bucket, kept by its layerwise reload: Engine.push_buffer_bytes);
- sync check (weight_sync.check_every > 0): the static state and the forward of one probe of
  prompt + rollout.max_new_tokens tokens, beside the engine;
- rollout: the static state beside the engine (train.py empties the trainer's cache after the
  push and the check, so no cached blocks stay).
Also the engine's KV capacity on its own GPUs and the KV room the planner keeps for
rollout.max_total_tokens (memory_model.kv_room_tokens: the shipped configs carry it), the host
memory of an offloaded optimizer and its host time per step at --host-cores-per-gpu (default: this
machine's cores over --gpus-per-node; figures from --host-adam, launch/gpu_check.py's measured line,
else planner.host_adam's built-in ones), warned past OFFLOAD_WARN_FRACTION of the update (and
whether Megatron's precision-aware optimizer, on the GPU and faster, would fit instead), the disk
a checkpoint and the Hugging Face export take and a checkpoint's save time against the
preemption window (warned beyond it), and the FLOPs of one step (gspo_mcore.planner.flops): the
update's model FLOPs (6N + attention a token, what an MFU divides) beside its hardware FLOPs (every
pass it makes: the recomputed forwards, and the forwards of the batch for pi_prox / pi_old, strict
exactness and the KL reference where they apply). A refused plan still prints its breakdown. The model is gspo_mcore.planner
(memory_model, costs, flops, host_adam); this module composes it and is its command line.

The estimates are arithmetic on the shapes, not measurements: activations follow
Korthikanti et al. 2022 (sequence parallel, fused attention) adapted to top-k experts;
expect them within ESTIMATE_TOLERANCE (1.5x; launch/smoke_1gpu.sh's memory check holds them to
it). An unfused O(s^2) attention is not modelled.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

from gspo_mcore.config import Config, ConfigError, load_config
from gspo_mcore.engines import engine_class
from gspo_mcore.common.errors import run_cli
from gspo_mcore.megatron.qwen3_moe.hf_config import Qwen3MoeArch, load_hf_config
from gspo_mcore.planner.costs import (CHECKPOINT_WRITE_GB_S, checkpoint_save_estimate, code_reward_estimate,
                                     disk_estimate, flops_per_step, routing_estimate)
from gspo_mcore.planner.host_adam import (ASSUMED_UPDATE_MFU, BUILT_IN, OFFLOAD_WARN_FRACTION, HostAdamFigures,
                                          host_adam_estimate, load_figures)
from gspo_mcore.planner.flops import H100_BF16_FLOPS
from gspo_mcore.planner.memory_model import (ESTIMATE_TOLERANCE, GB, H100_GB, KV_ROOM_MARGIN_GB,
                                             TRAINER_CONTEXT_GB, MemoryRefused, check_fits, check_kv_budget,
                                             check_layout, engine_kv_room_gb, kv_room_tokens, memory_estimate,
                                             optimizer_params_per_gpu, param_counts, phase_totals,
                                             precision_aware_alternative, requests_in_flight_estimate)


def plan(config: Config, arch: Qwen3MoeArch, nodes: int, gpus_per_node: int, gpu_memory_gb: float,
         prompt_tokens: int, host_cores_per_gpu: int | None = None, host_adam: HostAdamFigures = BUILT_IN,
         checkpoint_write_gb_s: float = CHECKPOINT_WRITE_GB_S) -> dict:
    """The layout, memory per phase with the margin kept, the KV room, disk and a save's time,
    FLOPs, an offloaded optimizer's host time (at `host_cores_per_gpu`, default this machine's
    cores over `gpus_per_node`); raises MemoryRefused (carrying all of it) when a phase does not fit."""
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
        free = engine_kv_room_gb(config, arch, gpu_memory_gb, memory["engine_push_buffers_gb"])
        if free <= 0:
            raise ConfigError(f"rollout.engine_tp {config.rollout.engine_tp}: {config.rollout.engine}'s weights alone "
                              f"({memory['engine_weights_gb']:.1f} GiB) do not fit a {gpu_memory_gb:g} GiB GPU")
        memory["engine_kv_cache_tokens"] = int(free * GB / memory["engine_kv_bytes_per_token"])
        check_kv_budget(config, memory)
    counts = param_counts(arch)
    memory.update(requests_in_flight_estimate(config, prompt_tokens))
    memory["kv_room_tokens"] = kv_room_tokens(config, arch, layout, gpu_memory_gb, prompt_tokens)
    disk, flops = disk_estimate(config, arch), flops_per_step(config, arch, prompt_tokens)
    result = {"gpus": layout.total_gpus, "trainer_gpus": layout.trainer_gpus, "rollout_gpus": layout.rollout_gpus,
              "data_parallel": layout.dp, "expert_data_parallel": layout.expert_dp,
              "params_total_b": counts["total"] / 1e9, "params_active_b": counts["active"] / 1e9,
              **memory, "estimate_tolerance": ESTIMATE_TOLERANCE, "gpu_memory_gb": gpu_memory_gb, "usable_gb": usable, "phases_gb": phases,
              "tightest_phase": tightest, "margin_gb": usable - phases[tightest],
              **disk, **checkpoint_save_estimate(disk["checkpoint_gb"], layout.trainer_gpus, gpus_per_node,
                                                 checkpoint_write_gb_s),
              **flops, **routing_estimate(config, arch, layout, prompt_tokens), **code_reward_estimate(config)}
    if config.optimizer.cpu_offload:
        result.update(precision_aware_alternative(config, arch, layout, gpu_memory_gb, prompt_tokens))
        cores = host_cores_per_gpu or max(1, (os.cpu_count() or 1) // gpus_per_node)
        # The update's GPU time from its model FLOPs at an assumed MFU, what the host's time is weighed against.
        update_s = flops["train_model_tflops"] * 1e12 / layout.trainer_gpus / (H100_BF16_FLOPS * ASSUMED_UPDATE_MFU)
        steps = config.train.num_minibatches * config.train.ppo_epochs
        result.update(host_adam_estimate(optimizer_params_per_gpu(config, arch, layout), steps, cores, update_s,
                                         host_adam))
    check_fits(config, result)
    return result


# Megatron-Bridge's measurement of an offloaded optimizer's step time against the optimizer on
# the GPU, for Qwen3-30B-A3B (quoted by issue #37; not measured here: launch/gpu_check.py's
# section 3 prints this machine's own ratio at 2 layers).
OFFLOAD_STEP_TIME = "1.9-4.2x"


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
      + f" ({config.model.dtype}; the peak at the {r['trainer_peak_at']}: {r['trainer_total_gb']:.1f}, activations "
        f"stored {r['trainer_stored_activations_gb']:.1f} + the larger of the logits and a layer's backward); "
        f"sync-check forward {r['trainer_check_forward_gb']:.1f}")
    if "host_optimizer_gb_per_gpu" in r:
        w(f"host memory: {r['host_optimizer_gb_per_gpu']:.1f} GiB per trainer GPU (offloaded Adam + fp32 gradient "
          f"copies)")
    for line in host_adam_lines(r):
        w(line)
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
    w(f"KV room: rollout.max_total_tokens up to {r['kv_room_tokens']:,} per server ("
      + (f"{KV_ROOM_MARGIN_GB:g} GiB left free in every phase beside the trainer" if config.weight_sync.colocate
         else "the engine's share of its GPU") + f"); this config: {config.rollout.max_total_tokens:,}")
    w(f"in flight: up to {r['requests_in_flight']} requests ({config.rollout.num_servers} server(s) x "
      f"{r['requests_per_server']}: rollout.max_running_requests {config.rollout.max_running_requests}, KV room "
      f"(rollout.max_total_tokens {config.rollout.max_total_tokens:,}) for {r['kv_requests_per_server']} of "
      f"{r['request_tokens']:,} tokens; one per server kept for the sync check)")
    if "routing_per_rank_gb" in r:
        w(f"routed experts (rollout.return_routed_experts): up to {r['routing_rank0_host_gb']:.1f} GiB on rank 0's "
          f"host (a batch and the requests in flight), {r['routing_per_rank_gb']:.2f} GiB a step to the busiest "
          "trainer rank (its rollouts, its stage's layers)")
    for line in disk_lines(config, r):
        w(line)
    for line in reward_lines(config):
        w(line)
    if r.get("precision_aware_fits"):
        w("faster where it fits: optimizer.precision_aware: true, optimizer.cpu_offload: false fits (bf16 Adam "
          f"moments on the GPU, {r['precision_aware_optimizer_gb']:.1f} GiB per GPU; margin "
          f"{r['precision_aware_margin_gb']:.1f} GiB at the {r['precision_aware_tightest_phase']} phase"
          + (f" with rollout.max_total_tokens {r['precision_aware_kv_room_tokens']:,}, its KV room, and "
             "optimizer.offload_grad_buffers: true" if config.weight_sync.colocate else "")
          + "): Megatron-Bridge measures CPU offload at "
          f"{OFFLOAD_STEP_TIME} the step time on Qwen3-30B-A3B")
    if "code_reward_core_s" in r:
        w(f"code reward (reward.name {config.reward.name}): ~{r['code_reward_core_s']:,.0f} CPU-s of sandbox a step "
          f"(harness only, up to {config.reward.code.max_train_tests} tests a response; every test at "
          f"reward.code.cpu_s: {r['code_reward_core_s_bound']:,.0f}), ~{r['code_reward_wall_s']:,.1f} s wall at "
          f"reward.workers {config.reward.workers} (bound {r['code_reward_wall_s_bound']:,.0f} s); "
          f"~{r['code_tests_per_s_per_node']:,.0f} trivial tests/s per node")
    w(flops_line(r))


def flops_line(r: dict) -> str:
    """A step's FLOPs: the model count (what an MFU divides) beside the hardware count (an HFU's)."""
    passes = ", ".join(r["train_forward_passes"])
    return (f"one step (upper bound, full-length responses): rollout {r['rollout_tflops']:.0f} TFLOP, "
            f"train {r['train_model_tflops']:.0f} TFLOP model, {r['train_tflops']:.0f} hardware (the update"
            + (f"; forwards of the batch: {passes}" if passes else "") + "); a token of the batch: "
            f"{r['model_flops_per_token'] / 1e9:.1f} GFLOP model (6N + attention: what an MFU divides), "
            f"{r['hardware_flops_per_token'] / 1e9:.1f} hardware (+ recompute and forward-only passes: an HFU's)")


def host_adam_lines(r: dict) -> list[str]:
    """An offloaded optimizer's host time, and the warning past OFFLOAD_WARN_FRACTION of the update."""
    if "host_adam_optimizer_step_s" not in r:
        return []
    lines = [f"offloaded Adam on the host: {r['host_adam_optimizer_step_s']:.1f} s per optimizer step "
             f"({r['host_adam_params_per_gpu'] / 1e9:.2f}B parameters per GPU x {r['host_adam_ns_per_param']:.2f} ns at "
             f"{r['host_adam_threads']} host thread{'s' if r['host_adam_threads'] != 1 else ''} per GPU: copy to host, "
             f"CPU step {r['host_adam_cpu_step_ns_per_param']:.2f}, copy back), {r['host_adam_training_step_s']:.1f} s "
             f"per training step ({r['host_adam_optimizer_steps']} optimizer steps) with the GPUs idle; the update's "
             f"own ~{r['update_compute_s']:.0f} s at {ASSUMED_UPDATE_MFU:.0%} MFU [{r['host_adam_source']}]"]
    if r["host_adam_fraction"] > OFFLOAD_WARN_FRACTION:
        lines.append(f"offload warning: the host's Adam adds {r['host_adam_fraction']:.0%} to the update's time (over "
                     f"{OFFLOAD_WARN_FRACTION:.0%}): more host cores per GPU (--host-cores-per-gpu), more nodes "
                     "(expert-DP shards the host's share), or the precision-aware optimizer on the GPU where it fits")
    return lines


CODE_REWARDS = ("code", "code_all", "gspo_mcore.rewards.code:")


def reward_lines(config: Config) -> list[str]:
    """A code reward whose call could time out on correct programs: reward.timeout_s against the
    call's longest honest run (rewards.code_config.CodeRewardConfig.group_seconds)."""
    reward = config.reward
    if not reward.name.startswith(CODE_REWARDS):
        return []
    programs = config.train.group_size if reward.batched else 1
    needed = reward.code.group_seconds(programs)
    if reward.timeout_s >= needed:
        return []
    c = reward.code
    return [f"reward warning: reward.timeout_s {reward.timeout_s:g} s is under what {programs} correct program"
            f"{'s' if programs > 1 else ''} of one call may take, {needed:g} s (each runs reward.code.max_train_tests "
            f"{c.max_train_tests} tests of up to cpu_s {c.cpu_s:g} s"
            + (f", built first in up to compile_cpu_s {c.compile_cpu_s:g}" if "cpp" in c.languages else "")
            + "): a call past it scores the whole group 0; raise reward.timeout_s, or lower max_train_tests or cpu_s"]


def disk_lines(config: Config, r: dict) -> list[str]:
    """What checkpoints, the export and a disk weight sync write, and a save's time."""
    t = config.train
    # costs.disk_estimate: the precision-aware optimizer saves the master weights' 16-bit remainders
    state = ("16-bit master remainders + 2 fp32 Adam moments" if config.optimizer.precision_aware
             else "fp32 master weights + 2 Adam moments")
    return [f"disk warning: each checkpoint ~{r['checkpoint_gb']:,.0f} GB (weights + {state}), written "
            f"{f'every {t.save_every} steps and ' if t.save_every else ''}at the end, up to "
            f"{r['checkpoints_on_disk']} at once (train.keep_checkpoints {t.keep_checkpoints}): "
            f"~{r['checkpoint_gb'] * r['checkpoints_on_disk']:,.0f} GB"
            + (f"; Hugging Face export ~{r['hf_export_gb']:,.0f} GB (train.export_hf)" if r["hf_export_gb"] else "")
            + (f"; each weight push writes ~{r['weight_sync_disk_gb']:,.0f} GB (weight_sync.method disk)"
               if r["weight_sync_disk_gb"] else ""), save_line(r)]


def save_line(r: dict) -> str:
    """A checkpoint's save time against the preemption window; a warning beyond it."""
    save = (f"a checkpoint's save: ~{r['checkpoint_save_s']:,.0f} s (~{r['checkpoint_node_gb']:,.0f} GB a trainer node "
            f"at {r['checkpoint_write_gb_s']:g} GB/s, --checkpoint-write-gb-s) of the {r['preemption_window_s']} s "
            "Slurm's time-limit warning leaves (GSPO_SAVE_TIMEOUT_S)")
    if r["checkpoint_save_s"] > r["preemption_window_s"]:
        return (f"preemption warning: {save}: the save on SIGUSR1 would be killed; raise --signal's lead and "
                "GSPO_SAVE_TIMEOUT_S, or write faster storage")
    return save


def shell_lines(config: Config, result: dict) -> list[str]:
    """KEY=value lines the launch scripts eval."""
    r = config.rollout
    values = (("ENGINE", r.engine), ("TRAINER_GPUS", result["trainer_gpus"]), ("ROLLOUT_GPUS", result["rollout_gpus"]),
              ("NUM_SERVERS", r.num_servers), ("ENGINE_TP", r.engine_tp),
              ("COLOCATE", int(config.weight_sync.colocate)), ("EXTERNAL_SERVERS", int(bool(r.urls))))
    return [f"GSPO_{key}={value}" for key, value in values]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gspo_mcore.planner.cli", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--hf-config", help="the model's config.json (default: model.hf_dir/config.json)")
    parser.add_argument("--gpu-memory-gb", type=float, default=H100_GB, help="GiB per GPU (default: an H100's)")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="prompt length for the FLOPs bound and the probes")
    parser.add_argument("--host-cores-per-gpu", type=int,
                        help="host cores each trainer GPU's offloaded Adam step gets (default: this machine's cores "
                             "over --gpus-per-node)")
    parser.add_argument("--host-adam", help="a measured host-Adam JSON line (launch/gpu_check.py's) in place of the "
                                            "built-in figures")
    parser.add_argument("--checkpoint-write-gb-s", type=float, default=CHECKPOINT_WRITE_GB_S,
                        help=f"a node's checkpoint write rate (default {CHECKPOINT_WRITE_GB_S:g} GB/s)")
    parser.add_argument("--shell", action="store_true",
                        help="print KEY=value lines for the launch scripts (the plan goes to stderr)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args(argv)

    warnings.filterwarnings("ignore", module="megatron")  # "Apex / TE not installed" on planning machines
    config = load_config(args.config, args.overrides)
    if args.nodes < 1 or args.gpus_per_node < 1:
        raise ConfigError("--nodes and --gpus-per-node must be >= 1")
    if args.host_cores_per_gpu is not None and args.host_cores_per_gpu < 1:
        raise ConfigError(f"--host-cores-per-gpu {args.host_cores_per_gpu}: must be >= 1")
    if not args.checkpoint_write_gb_s > 0:
        raise ConfigError(f"--checkpoint-write-gb-s {args.checkpoint_write_gb_s:g}: must be > 0")
    host_adam = load_figures(args.host_adam) if args.host_adam else BUILT_IN
    hf_config = Path(args.hf_config or Path(config.model.hf_dir) / "config.json")
    if not args.hf_config and not hf_config.is_file():  # planning comes before the download
        raise ConfigError(f"model.hf_dir: {hf_config} not found; without the weights on disk give the model's "
                          "config.json: --hf-config configs/hf/<model>.config.json")
    arch = load_hf_config(hf_config)
    out = sys.stderr if args.shell else sys.stdout  # --shell: stdout is eval'd
    try:
        result = plan(config, arch, args.nodes, args.gpus_per_node, args.gpu_memory_gb, args.prompt_tokens,
                      args.host_cores_per_gpu, host_adam, args.checkpoint_write_gb_s)
    except MemoryRefused as refused:  # the breakdown shows why, then the one-line error
        report(config, refused.result, out)
        raise
    report(config, result, out)
    print("\n".join(shell_lines(config, result)) if args.shell else json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
