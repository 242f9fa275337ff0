"""The engine's routed experts inside the trainer's forward: compared with the routers' own
choice (`routing_mismatch_fraction`), or replayed (R3, megatron-core's RouterReplay).

A microbatch carries `routing` [b, T, layers, top-k] (packing.input_aligned_routing: row t is
the routing of input token t), `layers` this rank's MoE layers only, in order (`RouterHooks.layers`:
gspo_mcore.megatron.routing_delivery sends each rank those). Megatron runs tokens as [T, b] (sequence-major) and, under
sequence parallelism, each TP rank holds a contiguous slice of T; a router sees its rank's
tokens flattened in that order, so that is the order the targets are laid out in.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from gspo_mcore.megatron.parallel import device


def local_targets(routing: torch.Tensor, layer: int) -> torch.Tensor:
    """The expert ids [T_local * b, top-k] of `routing`'s layer at position `layer` (of this
    rank's layers), in the order this rank's router sees its tokens (sequence-major, this TP
    rank's sequence-parallel slice)."""
    per_layer = routing[:, :, layer, :].transpose(0, 1)  # [T, b, k]
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp > 1:  # sequence parallel: contiguous chunks of T per TP rank
        per_layer = per_layer.chunk(tp)[parallel_state.get_tensor_model_parallel_rank()]
    return per_layer.reshape(-1, per_layer.shape[-1]).long()


def drop_padding_routes(router, inputs, output):
    """A forward hook on each MoE router (model.build_model, before the trainer's RouterHooks):
    the tokens GPTModel's `padding_mask` marks (True at padding; the MoE layer hands the router
    it as [T, b], the order the router flattens its tokens in) route to no expert, with no
    probability. megatron-core 0.16.1's TopKRouter uses the mask for its auxiliary losses and
    counts only (router.py `routing`); its routing map goes to the dispatcher as is, so padding
    rows ran through the experts and the all-to-all, and under routing replay all landed on
    experts 0..k-1 (packing.input_aligned_routing's fill). A token with no expert is sent
    nowhere: permute's masked_select skips it, unpermute scatters nothing into its zero row, the
    counts come from the map (moe_utils.py, token_dispatcher.py). Its output is the residual
    alone: no real token attends to a right padding position, and the loss masks it."""
    padding = inputs[1] if len(inputs) > 1 else None
    if padding is None:
        return output
    probs, routing_map = output
    keep = ~padding.reshape(-1, 1)
    return probs.masked_fill(~keep, 0.0), routing_map & keep


def out_tokens_from_the_map(dispatcher) -> None:
    """A dispatcher whose permutation is fused (`moe_permute_fusion`, the te spec: Transformer
    Engine's permute allocates `num_out_tokens` rows) sized by the routing map: drop-free,
    megatron-core 0.16.1 fixes it at tokens x top-k (token_dispatcher.py `preprocess`), which
    padding routed nowhere no longer fills. As megatron's own capacity branch does: the map's sum,
    read on the host at the permutation's start (one sync point moved earlier, none added)."""
    preprocess = dispatcher.preprocess

    def sized_by_the_map(routing_map):
        out = preprocess(routing_map)
        dispatcher.num_out_tokens = routing_map.sum()
        dispatcher._maybe_update_cuda_sync_point("before_permutation_1")
        return out

    dispatcher.preprocess = sized_by_the_map


def recomputing() -> bool:
    """Inside a backward pass: a forward recomputed for its gradients (megatron-core's
    CheckpointFunction.backward runs the layer again under the autograd engine, whose graph task
    is then current; torch._C._current_graph_task_id is -1 outside any backward)."""
    return torch._C._current_graph_task_id() != -1


class RouterHooks:
    """One forward hook per MoE router, for everything the trainer asks of its routers: each
    expert's load in training forwards (`imbalance`), and, with `engine_routing`, the engine's
    routed experts per microbatch (`before_forward(mb, compare)`): replayed (`replay`: the routers
    use them in forward and in a recomputed forward during backward) or, while `compare`, each
    (token, layer) whose top-k set differs from the engine's counted (`mismatch`). Counts stay on
    the routers' device: a .cpu() per layer would synchronise the GPU every forward."""

    def __init__(self, model, num_experts: int, *, engine_routing: bool = False, replay: bool = False):
        self.replay, self.engine_routing = replay, engine_routing
        self.routers = {}
        for layer in model.decoder.layers:
            router = getattr(getattr(layer, "mlp", None), "router", None)
            if router is not None:
                index = layer.layer_number - 1  # global layer number: the engine's row
                self.routers[index] = router
        # This rank's MoE layers (global numbers - 1, the engine's rows), in order: the layers of
        # the routing it is sent, position by position.
        self.layers = sorted(self.routers)
        self.position = {index: i for i, index in enumerate(self.layers)}
        # Kept to take the hooks off (`remove`): each closes over this object and its counts.
        self.handles = [router.register_forward_hook(self._hook(index)) for index, router in self.routers.items()]
        num_layers = model.config.num_layers
        self.load = torch.zeros(num_layers, num_experts, dtype=torch.float64, device=device())
        # Per layer: (differing, compared) over the sequences the trainer's own weights routed in
        # the engine, then over those older weights routed (asynchronous modes: compared apart,
        # the second also measures the policy's change).
        self.differing = torch.zeros(num_layers, 4, dtype=torch.float64, device=device())
        self.current: dict | None = None

    def before_forward(self, mb: dict, compare: bool = False) -> None:
        if not self.engine_routing or "routing" not in mb:
            self.current = None
            return
        self.current = {"routing": mb["routing"], "real": local_real_tokens(mb),
                        "older": local_real_tokens(mb, "older_inputs"), "compare": compare}
        if self.replay:
            for index, router in self.routers.items():
                router.router_replay.set_target_indices(local_targets(mb["routing"], self.position[index]))
                router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def after_forward(self) -> None:
        """1F1B runs backwards in forward order: a recomputed forward pops its own targets."""
        if self.replay:
            for router in self.routers.values():
                router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)

    def end_step(self) -> None:
        """After an optimizer step (or a forward-only pass): no target outlives its microbatch."""
        if self.replay:
            for router in self.routers.values():
                router.router_replay.clear_indices()
                router.router_replay.clear_router_replay_action()
        self.current = None

    def _hook(self, index: int):
        def hook(module, inputs, output):
            if recomputing():
                # Full recompute: this forward runs again inside backward, and under PP > 1 the
                # 1F1B schedule has run the next microbatch's forward (`current`) in between.
                # Each microbatch's routers count once, in its own forward.
                return
            routing_map = output[1].detach()  # [tokens, experts] bool
            if module.training:
                self.load[index] += routing_map.sum(0).double()
            if self.current is None or not self.current["compare"]:
                return
            targets = local_targets(self.current["routing"], self.position[index]).to(routing_map.device)
            engine = torch.zeros_like(routing_map).scatter_(1, targets, True)
            real = self.current["real"].to(routing_map.device)
            older = self.current["older"].to(routing_map.device)
            own = real & ~older
            differs = (routing_map != engine).any(-1)
            self.differing[index] += torch.stack([(differs & own).sum(), own.sum(), (differs & older).sum(),
                                                  older.sum()]).double()
        return hook

    def remove(self) -> None:
        """The hooks off the routers and what they counted or were given dropped (Learner.close). Idempotent."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self.routers, self.current = {}, None
        self.load = self.differing = None

    def reset(self) -> None:
        self.load.zero_()
        self.differing.zero_()

    def imbalance(self) -> list[float]:
        """Per MoE layer, max expert load / mean load over all ranks' tokens (1 = balanced). Collective."""
        load = self.load.clone()
        dist.all_reduce(load)
        return max_over_mean(load)

    def mismatch(self) -> tuple[float | None, list[float] | None, float | None]:
        """Over all ranks' tokens: the share of compared (token, MoE layer) pairs whose top-k sets
        differ among the sequences the trainer's weights routed in the engine, the same per MoE
        layer, and the share among those older weights routed (None: no such pair). Collective."""
        counts = self.differing.clone()
        dist.all_reduce(counts)
        rows = counts.cpu().tolist()
        differing, compared = sum(r[0] for r in rows), sum(r[1] for r in rows)
        older_differing, older = sum(r[2] for r in rows), sum(r[3] for r in rows)
        return ((differing / compared if compared else None),
                ([r[0] / r[1] for r in rows if r[1] > 0] if compared else None),
                (older_differing / older if older else None))


def max_over_mean(load: torch.Tensor) -> list[float]:
    """Per row of `load` [layers, experts] that holds any, max / mean; one copy to the host (a
    .item() and a truth test per row synchronised a GPU twice per MoE layer, 96 times a step at 48)."""
    ratios = load.max(1).values / load.mean(1)  # NaN (0 / 0) on a row without load: no MoE layer here
    return [r for r in ratios.cpu().tolist() if not math.isnan(r)]


def forget_router_replay(model) -> None:
    """`model`'s routers out of megatron-core's process-wide list of RouterReplay instances
    (transformer/moe/router_replay.py, RouterReplay.global_router_replay_instances: each router
    built with moe_enable_routing_replay appends its own there and nothing upstream takes it out
    but clear_global_router_replay_instances, which would take every model's). Each instance holds
    the targets it was last given."""
    ours = {id(m.router_replay) for m in model.modules() if getattr(m, "router_replay", None) is not None}
    instances = RouterReplay.global_router_replay_instances
    instances[:] = [r for r in instances if id(r) not in ours]


def local_real_tokens(mb: dict, key: str = "real_inputs") -> torch.Tensor:
    """[T_local * b] bool: this rank's token slots marked in `mb[key]` [b, T] (real_inputs: a
    real input token, not padding, not a filler microbatch), in the routers' order."""
    real = mb[key].bool().transpose(0, 1)  # [T, b]
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp > 1:
        real = real.chunk(tp)[parallel_state.get_tensor_model_parallel_rank()]
    return real.reshape(-1)


# What megatron-core 0.16.1's MoE token dispatchers (transformer/moe/token_dispatcher.py,
# MoEAlltoAllTokenDispatcher.dispatch_preprocess) keep of a microbatch after the MoE layer's forward
# until its next forward sets them again; read only between dispatch and combine, inside that
# forward. `probs` carries the autograd graph of the forward (a recomputed one in backward), and
# through it the layer's detached checkpoint input and that input's gradient.
DISPATCH_STATE = ("probs", "routing_map", "reversed_local_input_permutation_mapping", "tokens_per_expert")


def drop_dispatch_state(moe_layer, inputs, output) -> None:
    """A forward hook on each MoE layer (model.build_model): its dispatcher forgets the microbatch
    (DISPATCH_STATE). Kept, every layer's recomputed graph lived through the rest of the backward and
    past the step: at 48 layers and 16k tokens 3.4 GiB per GPU more at the training peak (the finished
    layers' input gradients) and 3.4 GiB through the weight push, the sync check and the rollout (the
    rehearsal's count, docs/08-gpu.md)."""
    dispatcher = moe_layer.token_dispatcher
    for name in DISPATCH_STATE:
        if getattr(dispatcher, name, None) is not None:
            setattr(dispatcher, name, None)
