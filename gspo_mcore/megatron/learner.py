"""The Megatron side of a step: the policy (model, DDP, optimizer), the frozen reference when a
KL term is on, and the GSPO update on one rollout batch.

pi_old of the update's first minibatch (theta = theta_old) is its own forward's log-probs,
detached (`loss.on_policy_first_minibatch`); the later minibatches take the engine's, with the
clip band widened to the mismatch the first one measured (`loss.band_from_mismatch`). No
separate old-policy forward and, unless `train.routing_replay`, no routing replay.
`token_logprobs_of` (forward only) serves the reference policy's log-probs and the comparison
arm that recomputes pi_old (`train.recompute_old_logprobs`).
"""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, get_moe_layer_wise_logging_tracker

from gspo_mcore.config import Config
from gspo_mcore.megatron.pipeline_loss import global_normalizer, make_loss_func
from gspo_mcore.metrics.report import all_to_floats, combine, update_report
from gspo_mcore.megatron.qwen3_moe.bootstrap import model_from_config, reference_model
from gspo_mcore.megatron.qwen3_moe.forward import last_stage_rank, response_logprobs
from gspo_mcore.megatron.qwen3_moe.hf_config import Qwen3MoeArch
from gspo_mcore.megatron.qwen3_moe.routing import RouterHooks, forget_router_replay
from gspo_mcore.megatron.optimizer import (lr_scheduler, offload_grad_buffers, optimizer_step, release_training,
                                           restore_grad_buffers, setup_training)
from gspo_mcore.gspo.packing import (balance_across_ranks, equalize_count, input_aligned_routing, microbatch_tensors,
                                pack_microbatches, sequence_lengths, split_minibatches, spread_over_response)
from gspo_mcore.megatron.parallel import device, end_model_parallel, model_parallel_groups
from gspo_mcore.config.validate import check_installed
from gspo_mcore.batch.rollout import Batch, Rollout
from gspo_mcore.common.seeds import step_seed


def _clear_module_caches(model) -> None:
    """The lru_caches on `model`'s module classes' forward (megatron-core 0.16.1
    models/common/embeddings/rotary_pos_embedding.py, RotaryEmbedding.forward: `@lru_cache(maxsize=32)`
    on the method, so the module and its cached embeddings are keys and values of a class-wide
    cache). Clearing is class-wide: another live model computes its embeddings again, once."""
    for cls in {type(module) for module in model.modules()}:
        cache_clear = getattr(cls.forward, "cache_clear", None)
        if cache_clear is not None:
            cache_clear()


def _gather_dp(values: list) -> list:
    out = [None] * parallel_state.get_data_parallel_world_size()
    dist.all_gather_object(out, values, group=parallel_state.get_data_parallel_group())
    return [v for part in out for v in part]


class Learner:
    """Built collectively on every rank; `update` and `token_logprobs_of` are collective too.
    `close` (or leaving a `with Learner(...)` block) gives back what it holds."""

    def __init__(self, config: Config, arch: Qwen3MoeArch | None = None):
        """`arch`: the process groups are joined (bootstrap.join_process_groups, the trainer builder's
        first statement) and stay the caller's; without it, building the model joins them and
        `close` ends them."""
        check_installed(config)  # before any memory is taken
        self.config, self.closed = config, False
        self.ddp = self.optimizer = self.scheduler = self.routers = self.reference = None
        torch.manual_seed(config.train.seed)
        self.arch, self.model = model_from_config(config, arch=arch)
        self._own_groups = model_parallel_groups() if arch is None else None
        try:
            self.ddp, self.optimizer = setup_training(self.model, config.optimizer)
            self.scheduler = lr_scheduler(self.optimizer, config.optimizer, config.train.steps)
            # Expert load, and the engine's routed experts in the policy's forward (compared or replayed).
            self.routers = RouterHooks(self.model, self.arch.num_experts,
                                       engine_routing=config.rollout.return_routed_experts,
                                       replay=config.train.routing_replay)
            self.reference = reference_model(config, self.arch) if config.loss.kl_loss_coef > 0 else None
        except BaseException:
            # A refusal after the model was built leaves no memory behind; the process groups stay
            # (ending them is collective, and this rank may be the only one that failed).
            self._release()
            raise
        self.grads_offloaded = False
        if config.optimizer.offload_grad_buffers:  # a colocated engine starts beside it: room from the start
            self.offload_grad_buffers()
        # The latest train-inference mismatch measured (loss.band_from_mismatch): an asynchronous
        # step whose first minibatch has no token of the current weights measures none and keeps
        # this one. Not checkpointed: a run's first step (a resume's too) generates with its own weights.
        self.last_mismatch: float | None = None

    # ------------------------------------------------------------ the end

    def close(self) -> None:
        """Give back what this learner holds, on every rank (collective where it ends the process
        groups it joined). Idempotent; a closed learner cannot update. Its model lives on only in
        the caller's own references (a weight sync's, a checkpointer's), its weights intact.

        A dropped learner kept its GPU memory (GPU round 5, G4: 21.7 GB after one, 30.3 after two):
        DDP's hooks on the parameters' C++ gradient accumulators held the DDP and its model in a
        cycle Python's collector cannot see (optimizer.release_training). The process-wide caches
        it filled go too: megatron-core's global memory buffer (the local spec's attention scores),
        RotaryEmbedding.forward's lru_cache (keyed on the module, its embeddings on the device),
        the routers' RouterReplay instances, the MoE loss-logging tracker and the aux-loss scale."""
        if self.closed:
            return
        self._release()
        if self._own_groups is not None:
            end_model_parallel(self._own_groups)
            self._own_groups = None
        gc.collect()  # what referred to itself (modules and their hooks) before the allocator's cache is emptied
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _release(self) -> None:
        """close's work on this rank alone (no collective), for whatever was built."""
        self.closed = True
        models = [m for m in (self.model, self.reference) if m is not None]
        if self.routers is not None:
            self.routers.remove()
        if self.ddp is not None:
            release_training(self.ddp, self.optimizer)
        for model in models:
            forget_router_replay(model)
            _clear_module_caches(model)
        get_moe_layer_wise_logging_tracker().clear()  # per-layer loss sums and the groups reducing them
        MoEAuxLossAutoScaler.main_loss_backward_scale = None  # the schedule sets it again (set_loss_scale)
        memory_buffer = parallel_state._GLOBAL_MEMORY_BUFFER  # None once destroy_model_parallel ran
        if memory_buffer is not None:  # GlobalMemoryBuffer (megatron/core/utils.py): made again on next use
            memory_buffer.buffer.clear()
        self.model = self.ddp = self.optimizer = self.scheduler = self.reference = self.routers = None

    # ------------------------------------------------------------ the gradient buffers

    def offload_grad_buffers(self) -> None:
        """The fp32 gradient buffers given back until the next update (optimizer.offload_grad_buffers:
        the trainer calls it before a colocated engine takes its memory again). Forward-only work
        (token_logprobs_of, a weight push, the sync check) needs no gradients."""
        offload_grad_buffers(self.ddp)
        self.grads_offloaded = True

    def restore_grad_buffers(self) -> None:
        """The gradient buffers taken again, zeroed (the trainer calls it once the colocated engine
        has released its memory; `update` makes sure of it). Nothing to do unless given back."""
        if self.grads_offloaded:
            restore_grad_buffers(self.ddp)
            self.grads_offloaded = False

    def __enter__(self) -> "Learner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ microbatches

    def microbatches(self, indices: list[int], rollouts: list[Rollout], advantages, extra=None,
                     routed_by_older: list[bool] | None = None, engine_routing: bool = True) -> list[dict]:
        """This rank's share of `indices`, packed by the token budget. Every data-parallel rank
        gets the same number of microbatches (fillers that add nothing): under expert
        parallelism a rank that finished early would leave its peers waiting in an all-to-all.
        `routed_by_older`: per rollout, whether older weights than these routed it in the engine
        (its routing is compared apart). `engine_routing`: False for a model that routes freely
        (the reference) whatever the policy does."""
        lengths = sequence_lengths(rollouts)
        shards = balance_across_ranks(indices, lengths, parallel_state.get_data_parallel_world_size())
        mine = pack_microbatches(shards[parallel_state.get_data_parallel_rank()], lengths,
                                 self.config.train.max_tokens_per_microbatch)
        tp = parallel_state.get_tensor_model_parallel_world_size()
        built = [microbatch_tensors(rollouts, advantages, members, tp, extra) for members in mine]
        if self.routers.engine_routing and engine_routing:
            for mb, members in zip(built, mine):
                older = [routed_by_older[i] for i in members] if routed_by_older is not None else None
                mb.update(input_aligned_routing([rollouts[i] for i in members], self.arch.num_experts,
                                                mb["inputs"].shape[1], older))
        count = torch.tensor([len(built)], device=device())
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=parallel_state.get_data_parallel_group())
        return equalize_count(built, int(count.item()))

    # ------------------------------------------------------------ forward only

    def token_logprobs_of(self, model, rollouts: list[Rollout]) -> list[list[float]]:
        """`model`'s log-prob of each response token of each rollout (temperature as the
        engine's), on every rank. `model`: the policy (its DDP wrapper) or the reference."""
        policy = model is self.ddp  # the reference routes freely
        microbatches = self.microbatches(list(range(len(rollouts))), rollouts, [0.0] * len(rollouts),
                                         engine_routing=policy)
        routing = self.routers if policy else None
        found = list(response_logprobs(model, microbatches, self.config.rollout.temperature, routing,
                                       fused_logprobs=self.config.model.fused_logprobs).items())
        # Only the last stage has them; every stage gets them (the loss runs on the last stage,
        # but the ranks stay consistent).
        gathered = [_gather_dp(found)]
        src = parallel_state.get_pipeline_model_parallel_last_rank()
        dist.broadcast_object_list(gathered, src=src, group=parallel_state.get_pipeline_model_parallel_group())
        values = dict(gathered[0])  # the trained tokens' only: an environment's tokens get 0, as the engine's
        return [spread_over_response(values[i], r.mask) for i, r in enumerate(rollouts)]

    def recompute_old_logprobs(self, rollouts: list[Rollout]) -> list[list[float]]:
        """The comparison arm: pi_old from a trainer forward instead of the engine's log-probs."""
        return self.token_logprobs_of(self.ddp, rollouts)

    # ------------------------------------------------------------ the update

    def update(self, batch: Batch, step: int, old_logprobs: list[list[float]] | None = None) -> dict:
        """`num_minibatches` optimizer steps (x ppo_epochs) on one rollout batch; the update's
        figures (metric_schema rows with `update`), the loss's combined exactly over microbatches
        and ranks, on every rank. {} when the batch is too small for the data-parallel ranks.
        The batch's minibatches are its own (`Batch.minibatches`, made once by the Trainer), or
        `minibatch_split`'s of step `step`. `old_logprobs`: pi_old recomputed by the trainer
        (default: the engine's log-probs). A batch with `stale` marks (asynchronous modes, with
        `old_logprobs` = pi_prox, or None: pi_prox from the first minibatch's own forward,
        loss.proximal first_minibatch): decoupled GSPO (loss.behavior_weight), ratios against
        pi_prox, the band sized from the mismatch on the current version's tokens as in sync; its
        `routed_by_older` rollouts have their routing compared apart."""
        cfg, rollouts = self.config.train, batch.rollouts
        minibatches = batch.minibatches if batch.minibatches is not None else self.minibatch_split(len(rollouts), step)
        if not minibatches:
            return {}
        extra = {}
        if self.reference is not None:
            extra["ref_logprobs"] = self.token_logprobs_of(self.reference, rollouts)
        if old_logprobs is not None:
            extra.update(old_logprobs=old_logprobs, engine_logprobs=[r.logprobs for r in rollouts])
        if batch.stale is not None:
            extra["stale"] = batch.stale
        self.restore_grad_buffers()  # backward writes into them: never into a given-back storage
        self.routers.reset()
        self.ddp.train()
        parts, grad_norms = [], []  # parts: per optimizer step, each microbatch's metrics
        band = None  # (clip_low, clip_high) after the first minibatch, with loss.band_from_mismatch
        real, slots = 0, 0  # this rank's real input tokens and input slots (host tensors: no device read)
        for _ in range(cfg.ppo_epochs):
            for mini in minibatches:
                first = not parts  # theta = theta_old: the engine/trainer differences alone
                microbatches = self.microbatches(mini, rollouts, batch.advantages, extra, batch.routed_by_older)
                real += sum(int(mb["input_real"].sum()) for mb in microbatches)
                slots += sum(mb["inputs"].numel() for mb in microbatches)
                step_parts, grad_norm = self._optimizer_step(
                    microbatches, band=band, on_policy=first and self.config.loss.on_policy_first_minibatch,
                    compare_routing=first)
                parts.append(step_parts)
                grad_norms.append(grad_norm)
                if first and self.config.loss.band_from_mismatch:
                    band = self._band_from_mismatch(parts[0])
        return {**self._report(parts), "grad_norm": sum(grad_norms) / len(grad_norms),
                "padding_fraction": padding_fraction(real, slots),
                "clip_band_high": band[1] if band else self.config.loss.clip_high,
                "minibatches": len(minibatches), "lr": self.optimizer.param_groups[0]["lr"]}

    def minibatch_split(self, count: int, step: int) -> list[list[int]]:
        """The update's minibatches of a batch of `count` rollouts: a shuffled order (the step's
        seed) in `num_minibatches` slices; none when too few rollouts feed the data-parallel ranks."""
        cfg = self.config.train
        num_minibatches = min(cfg.num_minibatches, count // parallel_state.get_data_parallel_world_size())
        if num_minibatches == 0:
            return []
        generator = torch.Generator().manual_seed(step_seed(cfg.seed, step))
        order = torch.randperm(count, generator=generator).tolist()  # host: an order of Python lists
        return [[order[i] for i in mini] for mini in split_minibatches(count, num_minibatches)]

    def routing_wanted(self, rollouts: list[Rollout], minibatches: list[list[int]], recompute: bool) -> list[int]:
        """The rollouts whose routed experts this rank's microbatches read in the update on
        `minibatches` (`minibatch_split`'s, the update's own) and in the forward that recomputes
        pi_old when `recompute`: its data-parallel shards of each."""
        lengths, ranks = sequence_lengths(rollouts), parallel_state.get_data_parallel_world_size()
        mine = parallel_state.get_data_parallel_rank()
        groups = minibatches + ([list(range(len(rollouts)))] if recompute else [])
        return sorted({i for group in groups for i in balance_across_ranks(group, lengths, ranks)[mine]})

    def _report(self, parts: list[list[dict]]) -> dict:
        """The loss's figures (from the last stage, where the loss runs) and the routers', on every rank."""
        metrics = [None]
        if parallel_state.is_pipeline_last_stage():
            per_rank = _gather_dp([parts])
            by_step = [[p for rank_parts in per_rank for p in rank_parts[k]] for k in range(len(parts))]
            metrics = [update_report(by_step)]
        dist.broadcast_object_list(metrics, src=last_stage_rank())
        # Compared with the engine's routing only when it sent it: no collective otherwise.
        routing_mismatch, per_layer, older = self.routers.mismatch() if self.routers.engine_routing else (None,) * 3
        return {**metrics[0], "router_max_over_mean_load": self.routers.imbalance(),
                "routing_mismatch_fraction": routing_mismatch, "routing_mismatch_fraction_per_layer": per_layer,
                "routing_mismatch_fraction_older": older}

    def _band_from_mismatch(self, first_parts: list[dict]) -> tuple[float, float] | None:
        """The clip band for the later minibatches: at least k x the mean per-sequence mismatch
        measured on the first (all its data-parallel ranks), or the latest one measured when the
        first has no token of the current weights (asynchronous modes: a stale token's difference
        is the policy's own change too). Only the last stage has a loss."""
        if not parallel_state.is_pipeline_last_stage():
            return None
        measured = combine(_gather_dp(first_parts)).get("mismatch_abs_log_ratio_mean")
        if measured is not None:
            self.last_mismatch = measured
        width = self.config.loss.band_from_mismatch * (self.last_mismatch or 0.0)
        return max(self.config.loss.clip_low, width), max(self.config.loss.clip_high, width)

    def _optimizer_step(self, microbatches: list[dict], band=None, on_policy: bool = False,
                        compare_routing: bool = False) -> tuple[list[dict], float]:
        """One optimizer step: (each microbatch's metrics (on the last stage; [] elsewhere), the grad norm)."""
        normalizer = global_normalizer(microbatches, self.config.horizon)

        def loss_for(mb):
            return make_loss_func(mb, normalizer, self.config.loss, self.config.rollout.temperature, len(microbatches),
                                  band=band, on_policy=on_policy)

        outputs, grad_norm = optimizer_step(self.ddp, self.optimizer, microbatches, loss_for, routing=self.routers,
                                            compare_routing=compare_routing,
                                            fused_logprobs=self.config.model.fused_logprobs)
        return all_to_floats(outputs), grad_norm


def padding_fraction(real: int, slots: int) -> float:
    """The share of the update's input slots that held padding (right padding to a microbatch's
    longest row, the TP multiple, filler microbatches), over the data-parallel ranks (each
    stage's and TP rank's microbatches are their DP rank's). Collective over the DP group."""
    total = torch.tensor([real, slots], dtype=torch.float64, device=device())
    dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
    real, all_slots = total.tolist()
    return 1.0 - real / all_slots if all_slots else 0.0
