"""Megatron DDP + optimizer around a model: the training-side Megatron wiring."""

from __future__ import annotations

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer

from gspo_mcore.config import ConfigError, OptimizerConfig
from gspo_mcore.megatron.qwen3_moe.forward import run_schedule


def setup_training(model, cfg: OptimizerConfig):
    """Wrap `model` (a GPTModel) in Megatron DDP and build its optimizer.
    Returns (ddp_model, optimizer); gradients are reduced in float32."""
    config = model.config
    ddp = DistributedDataParallel(
        config=config,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=cfg.distributed_optimizer,
        ),
        module=model,
    )
    # The schedule calls this after the last backward: DP all-reduce (or reduce-scatter),
    # TP all-reduce of sequence-parallel / QK-norm grads, PP embedding sync.
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(MegatronOptimizerConfig(**megatron_optimizer_settings(cfg, config)), [ddp])
    return ddp, optimizer


def megatron_optimizer_settings(cfg: OptimizerConfig, model_config) -> dict:
    """megatron-core 0.16.1's OptimizerConfig arguments for `cfg` and the model's TransformerConfig."""
    settings = dict(
        optimizer=cfg.name,
        lr=cfg.lr,
        min_lr=cfg.min_lr,  # each param group's bounds for the schedule (lr_scheduler)
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2,
        adam_eps=cfg.adam_eps,
        clip_grad=cfg.clip_grad,
        bf16=model_config.bf16,
        params_dtype=model_config.params_dtype,
        use_distributed_optimizer=cfg.distributed_optimizer,
    )
    if cfg.cpu_offload:
        # Megatron-LM's pairing for offload: the whole state on the host, the precision-aware
        # path, copies overlapped with compute. GPU only.
        settings.update(optimizer_cpu_offload=True, optimizer_offload_fraction=1.0, use_precision_aware_optimizer=True,
                        overlap_cpu_optimizer_d2h_h2d=True, decoupled_weight_decay=True)
    elif cfg.precision_aware:
        # _get_megatron_optimizer_based_on_param_groups hands the moments' dtypes to TE's FusedAdam
        # and, with fp32 main params, master_weights + use_decoupled_grad: TE keeps the master
        # weights (store_param_remainders, Megatron's default: the 16 low bits beside the bf16
        # weight) and reads the fp32 gradient buffer directly. OptimizerConfig.__post_init__
        # raises RuntimeError without TE's FusedAdam: say so in our terms first.
        try:
            from transformer_engine.pytorch.optimizers import FusedAdam  # noqa: F401
        except ImportError:
            raise ConfigError("optimizer.precision_aware: needs Transformer Engine's FusedAdam "
                              "(transformer_engine.pytorch.optimizers), not importable here; set it false") from None
        settings.update(use_precision_aware_optimizer=True, main_params_dtype=torch.float32,
                        main_grads_dtype=torch.float32, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    return settings


def lr_scheduler(optimizer, cfg: OptimizerConfig, total_steps: int):
    """The learning-rate schedule over training steps (rollout batches): Megatron's
    OptimizerParamScheduler (megatron/core/optimizer_param_scheduler.py), stepped once before each
    training step's update, so step k (from 1) uses its lr. The config's values win over a
    checkpoint's (override_opt_param_scheduler): a resume with a changed lr or schedule applies
    it at the restored step count."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if cfg.lr_warmup_steps else cfg.lr, max_lr=cfg.lr, min_lr=cfg.min_lr,
        lr_warmup_steps=cfg.lr_warmup_steps, lr_decay_steps=max(1, total_steps), lr_decay_style=cfg.lr_decay,
        start_wd=cfg.weight_decay, end_wd=cfg.weight_decay, wd_incr_steps=max(1, total_steps), wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True)


def optimizer_step(ddp, optimizer, microbatches: list[dict], loss_for, *, routing=None,
                   compare_routing: bool = False) -> tuple[list[dict], float]:
    """One optimizer step over `microbatches` (forward and backward through the pipeline
    schedule, the gradient reduction in finalize_model_grads, the step). Returns the loss
    functions' outputs (last pipeline stage; [] elsewhere) and the gradient norm before clipping
    (nan when the optimizer skipped the step). The trainer's update and the tests' reference
    steps both take their steps here."""
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    outputs = run_schedule(ddp, microbatches, loss_for, forward_only=False, routing=routing,
                           compare_routing=compare_routing)
    if routing is not None:
        routing.end_step()
    _, grad_norm, _ = optimizer.step()
    return outputs, float(grad_norm) if grad_norm is not None else float("nan")
