"""Megatron DDP + optimizer around a model: the training-side Megatron wiring."""

from __future__ import annotations

import warnings

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer

from gspo_mcore.config import ConfigError, OptimizerConfig
from gspo_mcore.gspo.loss import deferred_input_checks
from gspo_mcore.megatron.qwen3_moe.forward import run_schedule
from gspo_mcore.megatron.step_chunks import STEP_CHUNK_PARAMS, step_groups_in_chunks


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
    try:
        optimizer = get_megatron_optimizer(MegatronOptimizerConfig(**megatron_optimizer_settings(cfg, config)), [ddp])
    except BaseException:
        release_training(ddp, None)  # a refused optimizer leaves no DDP behind, hooked to the model
        raise
    if cfg.precision_aware:
        refuse_state_offload(optimizer)
        for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
            if getattr(chained, "optimizer", None) is not None:
                step_groups_in_chunks(chained.optimizer, STEP_CHUNK_PARAMS)
    fuse_torch_steps(optimizer)
    return ddp, optimizer


FUSABLE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


def fuse_torch_steps(optimizer) -> None:
    """torch's fused step (one kernel over a group's tensors, nothing allocated) for each torch
    Adam / AdamW / SGD megatron-core built. Without Transformer Engine or apex, megatron-core 0.16.1
    builds `torch.optim.AdamW(params, lr, weight_decay, betas, eps)` (optimizer/__init__.py,
    _get_megatron_optimizer_based_on_param_groups) with neither `fused` nor `foreach`, so torch
    takes its foreach path on CUDA, whose `_foreach_sqrt` of the second moments (torch/optim/
    adam.py `_multi_tensor_adam`) is an fp32 copy of a whole param group for the step: 4 bytes a
    parameter of the largest group (measured on CPU, tests/test_optimizer_memory.py), ~7.5 GiB on the
    30B config's 2-layer check. torch reads `group["fused"]` / `group["foreach"]` at each step, as
    megatron's own HybridDeviceOptimizer sets them (hybrid_optimizer.py); the state is empty here,
    so each `step` tensor is made where the fused kernel reads it (the parameter's device). A
    load puts the saved groups' flags back and may leave `step` on the host: the post-hook sets
    both again. Other optimizers (TE's FusedAdam, HybridDeviceOptimizer) are left as built."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    supported = set(_get_fused_kernels_supported_devices())
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(chained, "optimizer", None)
        if type(inner) not in FUSABLE:
            continue
        params = [p for group in inner.param_groups for p in group["params"]]
        if not all(p.is_floating_point() and p.device.type in supported for p in params):
            continue
        _fused_flags(inner)
        inner.register_load_state_dict_post_hook(_fused_after_load)


def _fused_flags(inner) -> None:
    for group in inner.param_groups:
        group["fused"], group["foreach"] = True, False


def _fused_after_load(inner) -> None:
    _fused_flags(inner)
    steps_on_param_devices(inner)


def steps_on_param_devices(inner) -> None:
    """Each parameter's Adam `step` where the fused kernel reads it: a float32 scalar on the
    parameter's device (torch's own placement for fused, adam.py `_init_group`)."""
    for group in inner.param_groups:
        if not group.get("fused"):
            continue
        for p in group["params"]:
            state = inner.state.get(p)
            if state and isinstance(state.get("step"), torch.Tensor) and state["step"].device != p.device:
                state["step"] = state["step"].to(device=p.device, dtype=torch.float32)


def release_training(ddp, optimizer) -> None:
    """Give back what setup_training built beside the model (Learner.close), on this rank only:
    DDP's gradient hooks (which kept the model and its buffers alive after the learner was
    dropped), its gradient buffers, the optimizer's states. The weights stay (the model is the
    caller's); neither can step again."""
    _remove_grad_hooks(ddp)
    offload_grad_buffers(ddp)
    if optimizer is not None:
        release_optimizer(optimizer)


# megatron-core 0.16.1's own `tensor.storage()` calls (param_and_grad_buffer.py, offload_to_cpu /
# reload_from_cpu) warn of TypedStorage's deprecation on every run that gives the buffers back: its
# code, not the user's, so not the user's warning to read.
warnings.filterwarnings("ignore", message=r"TypedStorage is deprecated", category=UserWarning,
                        module=r"megatron\.core\.distributed\.param_and_grad_buffer")


def offload_grad_buffers(ddp) -> None:
    """The fp32 gradient buffers given back (4 bytes a parameter this GPU holds): megatron-core
    0.16.1 DistributedDataParallel.offload_grad_buffers resizes each buffer's storage to 0
    (_ParamAndGradBuffer.offload_to_cpu with move_params=False: nothing is copied, the gradients
    are dropped); param.main_grad, the buckets' and the optimizer's views of it stay, empty, until
    `restore_grad_buffers`. Synchronized first: a step's kernels still reading them (an offloaded
    step's non-blocking copies to the host) finish; the allocator's cache emptied after, so an
    engine on the GPU can take the memory. A second call does nothing."""
    cuda = torch.cuda.is_available()
    ddp.offload_grad_buffers(synchronize=cuda, empty_cache=cuda)


def restore_grad_buffers(ddp) -> None:
    """The gradient buffers taken again after `offload_grad_buffers`: megatron-core 0.16.1
    DistributedDataParallel.restore_grad_buffers resizes each storage back and zeroes it
    (_ParamAndGradBuffer.reload_from_cpu), so every view of it is valid again. Nothing to do when
    they were not given back."""
    ddp.restore_grad_buffers(synchronize=torch.cuda.is_available())


def refuse_state_offload(optimizer) -> None:
    """megatron-core 0.16.1 MegatronOptimizer.offload_to_cpu / restore_from_cpu
    (optimizer/optimizer.py) move each parameter of the torch optimizer's groups with
    `p.data = p.data.cpu()` (and back). With the precision-aware optimizer those parameters are
    the bf16 shards of the model's own weights (distrib_optimizer.py, `shard_float16_params_this_group`
    as `orig_group["params"]`; TE's FusedAdam keeps the master weights' remainders against them):
    moved, they are copies, and the model never sees a step again. Refused on this optimizer
    (what a colocated run gives back is the gradient buffers: `offload_grad_buffers`)."""
    def refuse(*_args, **_kwargs):
        raise RuntimeError("optimizer.precision_aware: Megatron's offload_to_cpu / restore_from_cpu would replace "
                           "the optimizer's bf16 shard views of the weights with copies; give back the gradient "
                           "buffers instead (optimizer.offload_grad_buffers)")

    for megatron in [optimizer, *getattr(optimizer, "chained_optimizers", [])]:
        megatron.offload_to_cpu = megatron.restore_from_cpu = refuse


def release_optimizer(optimizer) -> None:
    """A Megatron optimizer's states and copies of the weights dropped: Adam's moments, the fp32
    main weights, a HybridDeviceOptimizer's pinned host copies. It cannot step again."""
    for megatron in getattr(optimizer, "chained_optimizers", [optimizer]):
        for name in _MAIN_PARAMS:  # the fp32 main weights of bf16 parameters
            if isinstance(getattr(megatron, name, None), list):
                getattr(megatron, name).clear()
        inner = getattr(megatron, "optimizer", None)  # None on a rank with no parameters of its kind
        for torch_optimizer in [inner, *getattr(inner, "sub_optimizers", [])] if inner is not None else []:
            torch_optimizer.state.clear()  # Adam's moments
            torch_optimizer.param_groups.clear()  # a distributed optimizer's fp32 shards, a host one's copies
            for name in _HOST_COPIES:
                if isinstance(getattr(torch_optimizer, name, None), dict):
                    getattr(torch_optimizer, name).clear()


# megatron-core 0.16.1: Float16OptimizerWithFloat16Params (optimizer/optimizer.py) and
# DistributedOptimizer (optimizer/distrib_optimizer.py) keep the fp32 main weights in these lists.
_MAIN_PARAMS = ("fp32_from_float16_groups", "shard_fp32_from_float16_groups", "shard_fp32_groups")
# megatron-core 0.16.1 optimizer/cpu_offloading/hybrid_optimizer.py, HybridDeviceOptimizer: the
# pinned host copies of the gradients, and the maps that hold the host (or fp32) copies of the weights.
_HOST_COPIES = ("cpu_copy_map_grad", "gpu_params_map_cpu_copy", "cpu_copys_map_gpu_param", "param_to_fp32_param",
                "fp32_param_to_orig_param", "param_to_inner_param", "inner_param_to_orig_param")


def _remove_grad_hooks(ddp) -> None:
    """megatron-core 0.16.1 DistributedDataParallel.__init__ hooks each parameter's gradient
    accumulator (`grad_acc.register_hook(self._make_backward_post_hook(param))`), keeps the
    accumulator in `grad_accs` and drops the handle. The hook closes over the DDP (its module, its
    buffers); the accumulator is a C++ autograd node, whose hooks Python's collector cannot see,
    and a stale graph also keeps it (a token dispatcher's last `probs`): that cycle is never
    collected. torch keeps one Python hook dict per node (torch/csrc/autograd/python_cpp_function.cpp,
    registerFunctionHook), and a new handle's hooks_dict_ref is that dict: cleared, DDP's hook goes."""
    for grad_acc in ddp.grad_accs:
        hooks = grad_acc.register_hook(_no_hook).hooks_dict_ref()
        if hooks is not None:
            hooks.clear()
    ddp.grad_accs.clear()


def _no_hook(*_):
    return None


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
        # weights (store_param_remainders: the 16 low bits beside the bf16 weight, the fp32 master
        # rebuilt from both at each step) and reads the fp32 gradient buffer directly. The
        # planner counts 6 bytes a parameter (2 + 2 moments, 2 remainder bits); with TE < 2.1
        # OptimizerConfig.__post_init__ turns the remainders off (fp32 masters, 8): refused. It
        # raises RuntimeError without TE's FusedAdam: say so in our terms first. A machine without
        # TE was refused before the model was built (config.validate.check_installed); this one
        # has the package but not its FusedAdam (TE's torch extension missing).
        try:
            from transformer_engine.pytorch.optimizers import FusedAdam  # noqa: F401
        except ImportError:
            raise ConfigError("optimizer.precision_aware: needs Transformer Engine's FusedAdam "
                              "(transformer_engine.pytorch.optimizers), not importable here; set it false") from None
        from megatron.core.utils import is_te_min_version

        if not is_te_min_version("2.1.0"):
            raise ConfigError("optimizer.precision_aware: needs Transformer Engine >= 2.1 (the fp32 master weights "
                              "as 16-bit remainders, store_param_remainders); an older one keeps them in fp32")
        settings.update(use_precision_aware_optimizer=True, store_param_remainders=True,
                        main_params_dtype=torch.float32, main_grads_dtype=torch.float32,
                        exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
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
                   compare_routing: bool = False, fused_logprobs: bool = False) -> tuple[list[dict], float]:
    """One optimizer step over `microbatches` (forward and backward through the pipeline
    schedule, the gradient reduction in finalize_model_grads, the step). Returns the loss
    functions' outputs (last pipeline stage; [] elsewhere) and the gradient norm before clipping
    (nan when the optimizer skipped the step). The trainer's update and the tests' reference
    steps both take their steps here."""
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    with deferred_input_checks() as checks:  # no host sync per microbatch (gspo_mcore.gspo.loss)
        outputs = run_schedule(ddp, microbatches, loss_for, forward_only=False, routing=routing,
                               compare_routing=compare_routing, fused_logprobs=fused_logprobs)
    if routing is not None:
        routing.end_step()
    checks.raise_if_any()  # once per step, before the update: a non-finite pi_old never steps
    _, grad_norm, _ = optimizer.step()
    return outputs, float(grad_norm) if grad_norm is not None else float("nan")
