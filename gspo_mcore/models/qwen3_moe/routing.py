"""The engine's routed experts inside the trainer's forward: compared with the routers' own
choice (`routing_mismatch_fraction`), or replayed (R3, megatron-core's RouterReplay).

A microbatch carries `routing` [b, T, layers, top-k] (packing.input_aligned_routing: row t is
the routing of input token t). Megatron runs tokens as [T, b] (sequence-major) and, under
sequence parallelism, each TP rank holds a contiguous slice of T; a router sees its rank's
tokens flattened in that order, so that is the order the targets are laid out in.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state


def local_targets(routing: torch.Tensor, layer: int) -> torch.Tensor:
    """Layer `layer`'s expert ids [T_local * b, top-k] in the order this rank's router sees
    its tokens (sequence-major, this TP rank's sequence-parallel slice)."""
    per_layer = routing[:, :, layer, :].transpose(0, 1)  # [T, b, k]
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp > 1:  # sequence parallel: contiguous chunks of T per TP rank
        per_layer = per_layer.chunk(tp)[parallel_state.get_tensor_model_parallel_rank()]
    return per_layer.reshape(-1, per_layer.shape[-1]).long()


class EngineRouting:
    """Hooks on the model's MoE routers. Per microbatch, `before_forward(mb)` hands them the
    engine's routing; with `replay` the routers use it in forward (and in a recomputed forward
    during backward), else they route freely and, while `compare` is on, each (token, layer)
    whose top-k set differs from the engine's is counted."""

    def __init__(self, model, replay: bool):
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        self.actions = RouterReplayAction
        self.replay, self.compare = replay, False
        self.routers = {}
        for layer in model.decoder.layers:
            router = getattr(getattr(layer, "mlp", None), "router", None)
            if router is not None:
                index = layer.layer_number - 1  # global layer number: the engine's row
                self.routers[index] = router
                router.register_forward_hook(self._hook(index))
        num_layers = model.config.num_layers
        self.counts = torch.zeros(num_layers, 2, dtype=torch.float64)  # (differing, compared) per layer
        self.current: dict | None = None

    def before_forward(self, mb: dict) -> None:
        if "routing" not in mb:
            self.current = None
            return
        self.current = {"routing": mb["routing"], "real": local_real_tokens(mb)}
        if self.replay:
            for index, router in self.routers.items():
                router.router_replay.set_target_indices(local_targets(mb["routing"], index).to(mb["inputs"].device))
                router.router_replay.set_router_replay_action(self.actions.REPLAY_FORWARD)

    def after_forward(self) -> None:
        """1F1B runs backwards in forward order: a recomputed forward pops its own targets."""
        if self.replay:
            for router in self.routers.values():
                router.router_replay.set_router_replay_action(self.actions.REPLAY_BACKWARD)

    def end_step(self) -> None:
        """After an optimizer step (or a forward-only pass): no target outlives its microbatch."""
        if self.replay:
            for router in self.routers.values():
                router.router_replay.clear_indices()
                router.router_replay.clear_router_replay_action()
        self.current = None

    def _hook(self, index: int):
        def hook(module, inputs, output):
            if not self.compare or self.current is None:
                return
            routing_map = output[1].detach().cpu()  # [tokens, experts] bool
            targets = local_targets(self.current["routing"], index).cpu()
            engine = torch.zeros_like(routing_map).scatter_(1, targets, True)
            real = self.current["real"]
            differs = (routing_map != engine).any(-1) & real
            self.counts[index] += torch.tensor([differs.sum().item(), real.sum().item()], dtype=torch.float64)
        return hook

    def reset(self) -> None:
        self.counts.zero_()

    def mismatch(self) -> tuple[float | None, list[float | None]]:
        """(share of compared (token, MoE layer) pairs whose top-k sets differ, the same per
        MoE layer) over all ranks' tokens. Collective."""
        from gspo_mcore.parallel import device

        counts = self.counts.to(device())
        dist.all_reduce(counts)
        rows = counts.cpu().tolist()
        differing, compared = sum(d for d, _ in rows), sum(n for _, n in rows)
        return (differing / compared if compared else None), [d / n for d, n in rows if n > 0]


def local_real_tokens(mb: dict) -> torch.Tensor:
    """[T_local * b] bool: this rank's token slots that hold a real input token (not padding,
    not a filler microbatch), in the routers' order."""
    real = mb["real_inputs"].bool().transpose(0, 1)  # [T, b]
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp > 1:
        real = real.chunk(tp)[parallel_state.get_tensor_model_parallel_rank()]
    return real.reshape(-1).cpu()
