"""The trainer's routers against the engine's routed experts (gspo_mcore.megatron.qwen3_moe.routing),
without a model: one stand-in router whose choice the test sets."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from gspo_mcore.megatron.qwen3_moe import routing as routing_module
from gspo_mcore.gspo.packing import input_aligned_routing
from gspo_mcore.batch.rollout import Rollout


class FixedRouter(nn.Module):
    """Returns (probs, routing_map) as megatron-core's TopKRouter does, routing_map [tokens,
    experts] from a set choice [tokens, k]."""

    def __init__(self, num_experts: int):
        super().__init__()
        self.num_experts, self.choice = num_experts, None

    def forward(self, x):
        routing_map = torch.zeros(x.shape[0], self.num_experts, dtype=torch.bool).scatter_(1, self.choice, True)
        return None, routing_map


def test_responses_older_weights_routed_are_compared_apart(monkeypatch):
    """Asynchronous modes: the engine routed a stale response with older weights, so its experts
    differ from the trainer's by the policy's change, not only numerics. Counted together they
    made routing_mismatch_fraction read 25% on a float32 engine; apart, the trainer's own
    responses read their numerics (here 0) and the older ones their own share (here all)."""
    monkeypatch.setattr(routing_module.parallel_state, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(routing_module.dist, "all_reduce", lambda tensor, *args, **kwargs: None)  # one rank
    router = FixedRouter(num_experts=4)
    layer = SimpleNamespace(layer_number=1, mlp=SimpleNamespace(router=router))
    hooks = routing_module.RouterHooks(SimpleNamespace(decoder=SimpleNamespace(layers=[layer]),
                                                       config=SimpleNamespace(num_layers=1)), 4, engine_routing=True)
    # Two responses of 3 input tokens (prompt 2 + response 2), the engine routing experts {0, 1}
    # for every token of both; version 0 routed the second, the trainer is at version 1.
    routed = torch.tensor([0, 1], dtype=torch.int32).expand(3, 1, 2).numpy()
    rollouts = [Rollout([5, 6], [7, 8], [-0.1, -0.2], "stop", version, routed_experts=routed)
                for version in ("step-1", "step-0")]
    mb = input_aligned_routing(rollouts, num_experts=4, width=3, routed_by_older=[False, True])
    # The trainer agrees with the engine on the first response, not on the second. Tokens reach
    # a router sequence-major ([T, b] flattened): token t of response i is row 2 t + i.
    router.choice = torch.tensor([[0, 1], [2, 3]] * 3)
    hooks.before_forward(mb, compare=True)
    router(torch.zeros(6, 8))
    assert hooks.mismatch() == (0.0, [0.0], 1.0)
    # In sync nothing is older: every response is compared as the trainer's own.
    hooks.reset()
    hooks.before_forward(input_aligned_routing(rollouts, num_experts=4, width=3), compare=True)
    router(torch.zeros(6, 8))
    assert hooks.mismatch() == (0.5, [0.5], None)


def test_a_forward_recomputed_in_backward_counts_nothing(monkeypatch):
    """Full recompute runs each layer's forward again inside backward; under PP > 1 the 1F1B
    schedule has meanwhile run the next microbatch's forward, so `current` is microbatch i+1's
    routing while microbatch i recomputes (a shape error when their widths differ, wrong counts
    when not). Each microbatch counts once, in its own forward; the load too."""
    monkeypatch.setattr(routing_module.parallel_state, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(routing_module.dist, "all_reduce", lambda tensor, *args, **kwargs: None)
    router = FixedRouter(num_experts=4)
    router.train()
    layer = SimpleNamespace(layer_number=1, mlp=SimpleNamespace(router=router))
    hooks = routing_module.RouterHooks(SimpleNamespace(decoder=SimpleNamespace(layers=[layer]),
                                                       config=SimpleNamespace(num_layers=1)), 4, engine_routing=True)
    routed = torch.tensor([0, 1], dtype=torch.int32).expand(3, 1, 2).numpy()
    first = input_aligned_routing([Rollout([5, 6], [7, 8], [-0.1, -0.2], "stop", "step-1", routed_experts=routed)],
                                  num_experts=4, width=3)
    wider = torch.tensor([0, 1], dtype=torch.int32).expand(5, 1, 2).numpy()
    second = input_aligned_routing([Rollout([5, 6], [7, 8, 9, 10], [-0.1] * 4, "stop", "step-1", routed_experts=wider)],
                                   num_experts=4, width=5)
    router.choice = torch.tensor([[0, 1]] * 3)  # microbatch 1 (3 tokens): the engine's choice
    weight = torch.ones(1, requires_grad=True)

    def layer_forward(x):
        return x * weight + router(x)[1].float().sum()

    hooks.before_forward(first, compare=True)
    out = torch.utils.checkpoint.checkpoint(layer_forward, torch.zeros(3, 8, requires_grad=True), use_reentrant=True)
    hooks.before_forward(second, compare=True)  # 1F1B: microbatch 2's forward before 1's backward
    out.sum().backward()  # microbatch 1 recomputed
    assert hooks.mismatch() == (0.0, [0.0], None)
    assert hooks.load[0].tolist() == [3.0, 3.0, 0.0, 0.0]


def test_load_imbalance_is_max_over_mean_per_loaded_layer_in_one_host_copy(monkeypatch):
    """router_max_over_mean_load: a layer without a router here (no load) is left out, the rest
    read max / mean; on a GPU each .item() waits for the device, so the figures come in one copy."""
    monkeypatch.setattr(routing_module.dist, "all_reduce", lambda tensor, *args, **kwargs: None)  # one rank
    layers = [SimpleNamespace(layer_number=n, mlp=SimpleNamespace(router=FixedRouter(4))) for n in (1, 3)]
    hooks = routing_module.RouterHooks(SimpleNamespace(decoder=SimpleNamespace(layers=layers),
                                                       config=SimpleNamespace(num_layers=3)), 4)
    hooks.load += torch.tensor([[4.0, 0.0, 2.0, 2.0], [0.0] * 4, [1.0] * 4], dtype=torch.float64)
    copies = []
    real_cpu = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: copies.append(self.shape) or real_cpu(self, *a, **k))
    monkeypatch.setattr(torch.Tensor, "item", lambda self: pytest.fail("a host sync per layer"))
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda self: pytest.fail("a truth test per layer"))
    assert hooks.imbalance() == [2.0, 1.0]
    assert copies == [torch.Size([3])]
