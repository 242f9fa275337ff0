"""One rank's rehearsed step: the production Learner (build_model, Megatron DDP, the distributed
optimizer, the loss, backward, the gradient sync, the optimizer) run as written on fake CUDA in a
fake world, with memory and FLOPs counted per phase.

What the production code reads that a fake rank cannot give, and what answers it instead:
- gspo_mcore/megatron/qwen3_moe/bootstrap.py `load_initial_weights`: the checkpoint read; fake
  weights have no values to load (replaced by a no-op here).
- megatron/core/transformer/moe/token_dispatcher.py `_maybe_dtoh_and_synchronize` (via
  moe_utils.py `maybe_move_tensor_to_cpu`) and moe_utils.py `permute`'s `masked_select`: the
  routing plan (gspo_mcore.rehearsal.plan).
- gspo_mcore/megatron/learner.py `Learner.microbatches`' `count.item()` (the all-reduced
  microbatch count): this rank's own count (a shadow value: gspo_mcore.rehearsal.mode).
- megatron/core/pipeline_parallel/p2p_communication.py `_communicate_shapes`' `.tolist()` of the
  received activation shape (pipeline parallel): the `tensor_shape` its caller expects.
- megatron/core/utils.py `local_multi_tensor_l2_norm` (`torch.tensor` of a list of device scalars,
  made on the host from their values) and megatron/core/optimizer/clip_grads.py's `.item()` of the
  norm: a stacked norm here, read as 0 (nothing is clipped: the step's memory and FLOPs do not
  depend on it).
- megatron/core/tensor_parallel/random.py `_get_cuda_rng_state` / `_set_cuda_rng_state`: a CPU
  build has no CUDA generators; the host generator's state stands in (fake kernels draw nothing).
- megatron/core/distributed/param_and_grad_buffer.py's `_coalescing_manager`: the fake world's
  (gspo_mcore.rehearsal.world).
- gspo_mcore/megatron/qwen3_moe/attention.py's `F.scaled_dot_product_attention`: a CPU build
  chooses the O(s^2) math path for CUDA tensors (its choice is a stub, not an op); the kernel an
  H100 takes is called instead: flash for 16-bit inputs without a mask, else memory-efficient.
- gspo_mcore/gspo/loss.py `InputChecks.raise_if_any`'s `.tolist()` of the first non-finite
  input per check: -1 (none; HOST_ANSWERS).
- the loss's figures and `.item()`s of device values made on the device (metrics): zeros; the
  report lists their lines (`unanswered`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from torch.utils._python_dispatch import _disable_current_modes

from gspo_mcore.rehearsal import memory as memory_counts
from gspo_mcore.rehearsal.flops import FlopCounter
from gspo_mcore.rehearsal.mode import FakeCuda, Rehearsal
from gspo_mcore.rehearsal.plan import RoutingPlan

aten = torch.ops.aten
# Host reads of values made on the device, answered by the project function reading them.
HOST_ANSWERS = {
    "gspo_mcore/gspo/loss.py:raise_if_any": -1,  # the first non-finite input's index: none
}


def rehearsable(config):
    """`config` as the rehearsal can run it, and what was changed: the `te` spec becomes the torch
    spec, the precision-aware optimizer GPU Adam (no Transformer Engine on CPU)."""
    changes = []
    model, optimizer = config.model, config.optimizer
    if model.spec == "te":
        model = dataclasses.replace(model, spec="torch")
        changes.append("model.spec te -> torch (no Transformer Engine on CPU)")
    if optimizer.precision_aware:
        optimizer = dataclasses.replace(optimizer, precision_aware=False)
        changes.append("optimizer.precision_aware -> GPU Adam (TE's FusedAdam is not installable here)")
    return dataclasses.replace(config, model=model, optimizer=optimizer), changes


def hf_config_file(source: Path, layers: int | None, out_dir: Path) -> Path:
    """The model's config.json, with `layers` decoder layers when given (the MoE layers' pattern kept);
    a config.json the model cannot take is refused first, in one line (HFConfigError)."""
    from gspo_mcore.megatron.qwen3_moe.hf_config import load_hf_config

    load_hf_config(source)
    cfg = json.loads(Path(source).read_text())
    if layers is not None:
        cfg["num_hidden_layers"] = layers
        cfg["mlp_only_layers"] = [i for i in cfg.get("mlp_only_layers", []) if i < layers]
    out = out_dir / "config.json"
    out.write_text(json.dumps(cfg))
    return out


def _bridge_megatron() -> None:
    from megatron.core import utils as mcore_utils
    from megatron.core.distributed import param_and_grad_buffer
    from megatron.core.optimizer import clip_grads
    from megatron.core.tensor_parallel import random as mcore_random

    import gspo_mcore.megatron.qwen3_moe.bootstrap as bootstrap
    import torch.distributed as dist

    bootstrap.load_initial_weights = lambda model, arch, config: None
    mcore_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda *a, **k: None
    param_and_grad_buffer._coalescing_manager = dist._coalescing_manager

    def stacked_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
        norms = [torch.linalg.vector_norm(t.float()) for tensors in tensor_lists for t in tensors]
        total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros((), device="cuda")
        return total.reshape(1), None

    torch.nn.functional.scaled_dot_product_attention = _sdpa_as_on_h100(torch.nn.functional.scaled_dot_product_attention)
    mcore_utils.local_multi_tensor_l2_norm = stacked_l2_norm
    if getattr(clip_grads.l2_norm_impl, "__name__", "") == "local_multi_tensor_l2_norm":  # no apex / TE
        clip_grads.l2_norm_impl = clip_grads.local_multi_tensor_l2_norm = stacked_l2_norm


def _sdpa_as_on_h100(sdpa):
    """F.scaled_dot_product_attention choosing its kernel as on an H100 for fake CUDA inputs:
    flash for 16-bit inputs without a mask, else the memory-efficient kernel (a CPU build's
    choice for CUDA tensors is always the O(s^2) math path: its kernel-choice stub is not a
    dispatched op a mode could answer)."""
    def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                     scale=None, enable_gqa=False):
        if query.device.type != "cuda" or enable_gqa:
            return sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, enable_gqa=enable_gqa)
        if attn_mask is None and query.dtype in (torch.bfloat16, torch.float16):
            return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False,
                                                            scale=scale)[0]
        return aten._scaled_dot_product_efficient_attention(query, key, value, attn_mask, query.requires_grad,
                                                            dropout_p, is_causal, scale=scale)[0]

    return scaled_dot_product_attention


def _storages(tensors) -> set[int]:
    return {t.untyped_storage()._cdata for t in tensors if isinstance(t, torch.Tensor)}


def static_kinds(learner) -> dict[int, str]:
    """Storage keys of the weights, the DDP gradient buffers and the optimizer's state."""
    kinds = {}
    for buffer in list(learner.ddp.buffers) + list(learner.ddp.expert_parallel_buffers):
        for key in _storages([buffer.param_data]):
            kinds[key] = "weights"
        for key in _storages([buffer.grad_data]):
            kinds[key] = "gradients"
    for key in _storages(learner.model.parameters()):
        kinds.setdefault(key, "weights")
    optimizers = getattr(learner.optimizer, "chained_optimizers", [learner.optimizer])
    for wrapper in optimizers:
        inner = wrapper.optimizer
        for group in inner.param_groups:
            for key in _storages(group["params"]):
                kinds.setdefault(key, "optimizer")
        for state in inner.state.values():
            for key in _storages(state.values()):
                kinds.setdefault(key, "optimizer")
    return kinds


@dataclasses.dataclass
class PhaseFigures:
    peak_bytes: int
    by_kind: dict[str, int]
    by_site: dict[str, int]
    flops: dict[str, float]
    host_peak_bytes: int = 0
    host_waits: dict[str, int] = dataclasses.field(default_factory=dict)  # GPU syncs by line (mode.py)


class RankRehearsal:
    """The modes, counters and bridges around one rank's production step. `with` it, `build`, then
    run the step with `phase` as its measure (gspo_mcore.rehearsal.phases.run_step); figures per
    phase in `phases`."""

    def __init__(self, config, rank: int, world_size: int, plan: RoutingPlan, vocab_per_rank: int,
                 expert_widths: set[int]):
        from gspo_mcore.rehearsal import world

        self.config, self.rank, self.plan = config, rank, plan
        world.join(rank, world_size)
        _bridge_megatron()
        self.device = memory_counts.Counter("cuda").install()
        self.host = memory_counts.Counter("cpu")
        self.flops = FlopCounter(vocab_per_rank, expert_widths)
        self.fake = FakeCuda(allow_non_fake_inputs=True)
        self.mode = Rehearsal(plan, {"cuda": self.device, "cpu": self.host}, self.flops, HOST_ANSWERS)
        self.phases: dict[str, PhaseFigures] = {}  # the largest peak of each phase's runs
        self.runs: list[tuple[str, PhaseFigures]] = []
        self.learner = None

    def __enter__(self):
        self.fake.__enter__()
        self.mode.__enter__()
        self._saved = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._saved.__enter__()
        return self

    def __exit__(self, *exc):
        self._saved.__exit__(*exc)
        self.mode.__exit__(*exc)
        self.fake.__exit__(*exc)

    def _pack(self, tensor):
        if isinstance(tensor, torch.Tensor) and tensor.device.type == "cuda":
            with _disable_current_modes():
                self.device.saved(tensor.untyped_storage())
        return tensor

    def build(self):
        from gspo_mcore.megatron.learner import Learner

        self.learner = Learner(self.config)
        return self.learner

    def phase(self, name: str, run) -> None:
        """`run` (one phase's body: gspo_mcore.rehearsal.phases) counted as phase `name`."""
        self.device.mark_static(static_kinds(self.learner))
        self.device.start_phase()
        self.host.start_phase()
        self.flops.reset()
        self.mode.host_waits = {}
        run()
        peak = self.device.peak
        self.runs.append((name, figures := PhaseFigures(peak.bytes, peak.by_kind, peak.by_site,
                                                            dict(self.flops.by_kind), self.host.peak.bytes,
                                                            self.mode.host_waits)))
        previous = self.phases.get(name)
        if previous is None or figures.peak_bytes >= previous.peak_bytes:
            self.phases[name] = figures
