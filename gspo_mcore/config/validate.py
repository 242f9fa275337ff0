"""Checks that read more than one section of a run config; each section checks its own fields
(`check` in gspo_mcore.config.schema). `validate` runs both, every section first.

This module imports nothing of the schema (whose `Config.validate` calls it): its functions take
a gspo_mcore.config.Config as `config`."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys

from gspo_mcore.common.errors import InputError


class ConfigError(InputError):
    """A config file or override that does not fit the schema (gspo_mcore.config.schema)."""


def validate(config):
    """`config` itself when every check passes; ConfigError naming the field otherwise."""
    for section in dataclasses.fields(config):
        check = getattr(getattr(config, section.name), "check", None)
        if check is not None:
            check()
    for check in (_model_and_device, _optimizer, _rollout_mode, _evaluation, _weight_sync):
        check(config)
    return config


def check_installed(config) -> None:
    """What `config` needs installed on this machine, refused before anything is built
    (gspo_mcore.megatron.learner.Learner's first statement: a refusal from Megatron's
    OptimizerConfig came after the model and its DDP buffers, ~10 GB on a GPU, and they stayed).
    Not part of `validate`: the planner plans GPU configs on machines where none of it is
    installed. Modules are looked up, not imported (no torch at config time)."""
    if config.optimizer.precision_aware and not _installed("transformer_engine"):
        raise ConfigError("optimizer.precision_aware: needs Transformer Engine's FusedAdam (transformer_engine), "
                          "not installed here; set it false")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # imported without a spec (a stand-in module): there
        return sys.modules.get(module) is not None


def _model_and_device(config) -> None:
    if config.model.spec == "te" and config.distributed.device != "cuda":
        raise ConfigError("model.spec: 'te' (Transformer Engine) needs distributed.device 'cuda'")
    if config.train.routing_replay and not config.rollout.return_routed_experts:
        raise ConfigError("train.routing_replay: needs rollout.return_routed_experts (the routing to replay)")


def _optimizer(config) -> None:
    opt, cuda = config.optimizer, config.distributed.device == "cuda"
    if opt.cpu_offload and (not cuda or not opt.distributed_optimizer):
        raise ConfigError("optimizer.cpu_offload: needs distributed.device 'cuda' and optimizer.distributed_optimizer")
    if opt.precision_aware and (not cuda or not opt.distributed_optimizer or opt.name != "adam"
                                or config.model.dtype != "bfloat16"):
        raise ConfigError("optimizer.precision_aware: needs distributed.device 'cuda' (Transformer Engine's FusedAdam), "
                          "optimizer.distributed_optimizer, optimizer.name 'adam' and model.dtype 'bfloat16'")
    if opt.offload_grad_buffers and not config.weight_sync.colocate:
        # Given back to an engine on the same GPU: a split engine has GPUs of its own.
        raise ConfigError("optimizer.offload_grad_buffers: gives the gradient buffers to a colocated engine while it "
                          "generates: needs weight_sync.colocate")
    if not 0 <= opt.lr_warmup_steps < config.train.steps:
        raise ConfigError(f"optimizer.lr_warmup_steps: {opt.lr_warmup_steps} must be within "
                          f"[0, train.steps) ({config.train.steps})")


def _rollout_mode(config) -> None:
    mode = config.rollout.mode
    if mode != "sync" and config.weight_sync.colocate:
        raise ConfigError(f"rollout.mode: {mode!r} overlaps generation and training, which colocated "
                          "servers cannot (they share the trainer's GPUs): use a split config or mode 'sync'")
    if mode == "async" and config.reward.norm == "batch":
        raise ConfigError("reward.norm: 'batch' has no batch in rollout.mode 'async' (groups finish one by one): "
                          "use 'group', 'running' or 'none'")
    if config.loss.mismatch_correction != "none" and mode != "sync":
        raise ConfigError(f"loss.mismatch_correction: applies in rollout.mode sync (in {mode} the "
                          "behaviour weight carries pi_prox / pi_engine)")


def _evaluation(config) -> None:
    for i, d in enumerate(config.eval.datasets):
        if d.temperature == 0 and config.rollout.function != "single_turn":
            # A rollout function's engine calls check their sampling as training's do.
            raise ConfigError(f"eval.datasets[{i}] ({d.name}): temperature 0 (greedy) runs single-turn "
                              f"only, not through rollout.function {config.rollout.function}")


def _weight_sync(config) -> None:
    ws, d = config.weight_sync, config.distributed
    if ws.method == "distributed" and ws.colocate and d.device == "cuda":
        raise ConfigError("weight_sync.method: 'distributed' cannot reach colocated servers (NCCL refuses two ranks "
                          "on one GPU): use 'tensor' (or 'disk')")
    if ws.method == "tensor" and d.expert_tensor_parallel != 1:
        raise ConfigError("weight_sync.method: 'tensor' needs distributed.expert_tensor_parallel 1")
