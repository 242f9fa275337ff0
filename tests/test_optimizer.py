"""gspo_mcore.megatron.optimizer's arguments to megatron-core 0.16.1 for the precision-aware optimizer.
It runs on Transformer Engine's FusedAdam, which is CUDA only: here, Megatron's own OptimizerConfig
takes the arguments (with a FusedAdam of TE's signature in place), and the upstream lines the
planner's bytes rely on are read (launch/gpu_check.py's section 3 builds and steps it on a GPU)."""

import inspect
import sys
import types
from types import SimpleNamespace

import pytest
import torch
from packaging.version import Version

import megatron.core.optimizer as megatron_optimizer
import megatron.core.utils
from gspo_mcore.config import ConfigError, load_config
from gspo_mcore.megatron.optimizer import megatron_optimizer_settings
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig

GPU_BF16 = ["distributed.device=cuda", "model.dtype=bfloat16"]
BF16_MODEL = SimpleNamespace(bf16=True, params_dtype=torch.bfloat16)


@pytest.fixture
def te_fused_adam(monkeypatch):
    """A FusedAdam with TE 2.10's constructor (the arguments Megatron's __post_init__ inspects), TE 2.10."""
    class FusedAdam:
        def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, *,
                     bias_correction=True, adam_w_mode=True, capturable=False, master_weights=False,
                     master_weight_dtype=torch.float32, exp_avg_dtype=torch.float32,
                     exp_avg_sq_dtype=torch.float32, use_decoupled_grad=False, store_param_remainders=False):
            pass

    for name in ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.optimizers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["transformer_engine.pytorch.optimizers"].FusedAdam = FusedAdam
    monkeypatch.setattr(megatron.core.utils, "_te_version", Version("2.10.0"))  # the image's (constraints.txt)


def test_megatron_takes_the_precision_aware_arguments(te_fused_adam):
    cfg = load_config(None, [*GPU_BF16, "optimizer.precision_aware=true"]).optimizer
    settings = megatron_optimizer_settings(cfg, BF16_MODEL)
    assert (settings["exp_avg_dtype"], settings["exp_avg_sq_dtype"]) == (torch.bfloat16, torch.bfloat16)
    assert settings["main_params_dtype"] == torch.float32 and "optimizer_cpu_offload" not in settings
    megatron = MegatronOptimizerConfig(**settings)  # __post_init__: adam, distributed optimizer, TE's FusedAdam
    assert megatron.use_precision_aware_optimizer_no_fp8_or_ds_fp8  # TE keeps the master weights
    assert megatron.store_param_remainders  # TE >= 2.1: 2 bytes of master weight (gspo_mcore.planner.cli)


def test_without_it_megatron_keeps_fp32_states_and_offload_its_own_pairing():
    plain = megatron_optimizer_settings(load_config(None, GPU_BF16).optimizer, BF16_MODEL)
    assert "use_precision_aware_optimizer" not in plain
    assert MegatronOptimizerConfig(**plain).exp_avg_dtype == torch.float32
    offload = megatron_optimizer_settings(load_config(None, [*GPU_BF16, "optimizer.cpu_offload=true"]).optimizer,
                                          BF16_MODEL)
    assert offload["optimizer_cpu_offload"] and "exp_avg_dtype" not in offload


def test_without_transformer_engine_it_is_one_line_naming_the_field(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # import fails
    cfg = load_config(None, [*GPU_BF16, "optimizer.precision_aware=true"]).optimizer
    with pytest.raises(ConfigError, match=r"^optimizer.precision_aware: needs Transformer Engine's FusedAdam "):
        megatron_optimizer_settings(cfg, BF16_MODEL)


def test_megatron_hands_the_moments_dtypes_and_master_weights_to_fused_adam():
    """The upstream lines the arguments above rely on (megatron/core/optimizer/__init__.py,
    _get_megatron_optimizer_based_on_param_groups): read, since only a GPU runs them."""
    source = inspect.getsource(megatron_optimizer._get_megatron_optimizer_based_on_param_groups)
    for line in ('"exp_avg_dtype": config.exp_avg_dtype', '"exp_avg_sq_dtype": config.exp_avg_sq_dtype',
                 '"master_weight_dtype": config.main_params_dtype', '"use_decoupled_grad": True',
                 '"store_param_remainders": config.store_param_remainders'):
        assert line in source


def test_release_drops_a_host_optimizers_copies_and_states(monkeypatch):
    """Learner.close: a HybridDeviceOptimizer (optimizer.cpu_offload) keeps host copies of the weights
    and gradients (pinned on a GPU run) beside its sub-optimizers' Adam states, and a distributed
    optimizer fp32 main weights: after release_optimizer none of them is held. The attribute names
    are megatron-core 0.16.1's (read here: a rename upstream fails this test, not a GPU run)."""
    import weakref

    from megatron.core.optimizer import distrib_optimizer, optimizer as mixed_precision
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    from gspo_mcore.megatron.optimizer import _HOST_COPIES, _MAIN_PARAMS, release_optimizer

    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: None)  # its copy streams: unused on CPU
    weight = torch.nn.Parameter(torch.randn(8))
    hybrid = HybridDeviceOptimizer([weight], offload_fraction=1.0, cpu_optimizer_cls=torch.optim.Adam,
                                   gpu_optimizer_cls=torch.optim.Adam, overlap_cpu_optimizer_d2h_h2d=False,
                                   pin_cpu_grads=False, pin_cpu_params=False, lr=0.1)
    assert all(isinstance(getattr(hybrid, name), dict) for name in _HOST_COPIES)
    # What a GPU step leaves: a host copy of the weight, its gradient's copy, the host Adam's moments.
    host_copy, grad_copy, moment = torch.randn(8), torch.zeros(8), torch.zeros(8)
    hybrid.gpu_params_map_cpu_copy[weight], hybrid.cpu_copys_map_gpu_param[host_copy] = host_copy, weight
    hybrid.cpu_copy_map_grad[host_copy] = grad_copy
    hybrid.cpu_optimizers[0].state[host_copy] = {"exp_avg": moment}
    main_weight = torch.zeros(8)
    megatron = SimpleNamespace(optimizer=hybrid, shard_fp32_from_float16_groups=[[main_weight]])
    held = [weakref.ref(t) for t in (host_copy, grad_copy, moment, main_weight)]
    del host_copy, grad_copy, moment, main_weight

    release_optimizer(SimpleNamespace(chained_optimizers=[megatron]))
    assert [ref() for ref in held] == [None] * 4
    assert all(not sub.param_groups and not sub.state for sub in hybrid.sub_optimizers)
    sources = inspect.getsource(distrib_optimizer) + inspect.getsource(mixed_precision)
    assert all(f"self.{name}" in sources for name in _MAIN_PARAMS)


# ------------------------------------------------------------------ #47 item 5
def test_the_master_weights_are_kept_as_remainders_and_an_older_transformer_engine_is_refused(te_fused_adam,
                                                                                           monkeypatch):
    """store_param_remainders is asked for, not left to Megatron's default: with TE < 2.1
    OptimizerConfig.__post_init__ turns it off silently (fp32 master weights: 8 bytes a parameter,
    not the planner's 6), so that TE is refused in one line."""
    cfg = load_config(None, [*GPU_BF16, "optimizer.precision_aware=true"]).optimizer
    assert megatron_optimizer_settings(cfg, BF16_MODEL)["store_param_remainders"] is True
    assert "if not is_te_min_version(\"2.1.0\"):\n                self.store_param_remainders = False" in \
        inspect.getsource(MegatronOptimizerConfig.__post_init__)
    monkeypatch.setattr(megatron.core.utils, "_te_version", Version("2.0.0"))
    with pytest.raises(ConfigError, match=r"^optimizer.precision_aware: needs Transformer Engine >= 2.1 "):
        megatron_optimizer_settings(cfg, BF16_MODEL)


def test_megatrons_state_offload_is_refused_on_a_precision_aware_optimizer():
    """megatron-core 0.16.1's MegatronOptimizer.offload_to_cpu moves each parameter of the torch
    optimizer's groups (`p.data = p.data.cpu()`), and with the precision-aware optimizer those are
    the bf16 shard views of the model's weights (DistributedOptimizer's `shard_float16_params_this_group`
    as the groups' params): moved, the model would never see a step again. setup_training puts
    this refusal on such an optimizer and each it chains (read here: only a GPU builds one)."""
    from megatron.core.optimizer import distrib_optimizer, optimizer as mixed_precision

    from gspo_mcore.megatron import optimizer as ours

    chained = SimpleNamespace(chained_optimizers=[SimpleNamespace(), SimpleNamespace()])
    ours.refuse_state_offload(chained)
    for target in (chained, *chained.chained_optimizers):
        for method in (target.offload_to_cpu, target.restore_from_cpu):
            with pytest.raises(RuntimeError, match=r"^optimizer.precision_aware: Megatron's offload_to_cpu / "
                                                   r"restore_from_cpu would replace the optimizer's bf16 shard views"):
                method()
    assert "p.data = p.data.cpu()" in inspect.getsource(mixed_precision.MegatronOptimizer.offload_to_cpu)
    assert "*shard_float16_params_this_group," in inspect.getsource(distrib_optimizer)
    assert "if cfg.precision_aware:\n        refuse_state_offload(optimizer)" in inspect.getsource(ours.setup_training)


def test_the_gradient_buffers_are_given_back_and_taken_by_megatrons_own_calls():
    """offload_grad_buffers / restore_grad_buffers are megatron-core 0.16.1's DDP methods: the
    storage resized to 0 (no host copy: move_params=False) and back, zeroed; synchronized, and the
    cache emptied, only where CUDA is (this CPU-only torch has neither)."""
    import megatron.core.distributed.distributed_data_parallel as ddp_module
    import megatron.core.distributed.param_and_grad_buffer as buffers

    from gspo_mcore.megatron.optimizer import offload_grad_buffers, restore_grad_buffers

    calls = []
    ddp = SimpleNamespace(offload_grad_buffers=lambda **kw: calls.append(("offload", kw)),
                          restore_grad_buffers=lambda **kw: calls.append(("restore", kw)))
    offload_grad_buffers(ddp)
    restore_grad_buffers(ddp)
    assert calls == [("offload", {"synchronize": False, "empty_cache": False}), ("restore", {"synchronize": False})]
    source = inspect.getsource(ddp_module.DistributedDataParallel.offload_grad_buffers)
    assert "buffer.offload_to_cpu(move_params=False, move_grads=True)" in source
    assert "self.grad_data.storage().resize_(0)" in inspect.getsource(buffers._ParamAndGradBuffer.offload_to_cpu)
    reload = inspect.getsource(buffers._ParamAndGradBuffer.reload_from_cpu)
    assert "self.grad_data.storage().resize_(self.grad_data_size)" in reload and "self.grad_data.zero_()" in reload
