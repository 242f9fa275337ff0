"""The engine's routed experts reach each trainer rank as the rows its update reads and the
layers its stage holds (gspo_mcore.megatron.routing_delivery), uint8 as the engine sent them: not the
whole batch to every rank (~1.5 GB pickled per rank per step at the 30B shape)."""

import numpy as np
import pytest
import torch

from conftest import plan_layout_job

LENGTHS = [5, 9, 3, 12, 7, 4, 10, 6]  # rows of routing per rollout (prompt + response - 1 tokens)
STEP = 3
plan_layout_job("routing_delivery", "routing_delivery", ["DP2", "PP2"], ["rollout.return_routed_experts=true"],
                batch=lambda hf_dir: {"lengths": LENGTHS, "step": STEP})


def _sent(i: int) -> np.ndarray:
    """What the engine sent for rollout i (as tests/workers/jobs.py makes it)."""
    n = LENGTHS[i]
    return ((np.arange(n * 4 * 2).reshape(n, 4, 2) + 7 * i) % 251).astype(np.uint8)


# The tiny model's layer 1 is dense (tests/conftest.py): its rows go nowhere.
@pytest.mark.parametrize("layout, layers", [("DP2", [[0, 2, 3], [0, 2, 3]]), ("PP2", [[0], [2, 3]])])
def test_each_rank_gets_the_rows_and_layers_it_reads(layout_output, layout, layers):
    """DP2: each rank its own rollouts (about half the batch), every MoE layer; PP2: every
    rollout, each stage its own MoE layers. Exactly what the rank's microbatches read: nothing
    missing (the update would fail), nothing more (what this delivery saves)."""
    out = layout_output(layout, "routing_delivery")
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for rank, layer_rows in zip(ranks, layers):
        assert rank["layers"] == layer_rows
        assert sorted(rank["got"]) == rank["reads"]
        for i, got in rank["got"].items():
            assert got.dtype == torch.uint8
            assert np.array_equal(got.numpy(), _sent(i)[:, layer_rows])
    moe_rows = sum(LENGTHS) * 3 * 2  # every rollout's rows of the 3 MoE layers, once over the ranks
    received = [sum(got.numel() for got in rank["got"].values()) for rank in ranks]
    assert sum(received) == moe_rows  # DP2: the rollouts split; PP2: the layers split
    assert ranks[0]["largest_mb"] == pytest.approx(max(received) / 2**20)
    if layout == "DP2":
        assert set(ranks[0]["got"]).isdisjoint(ranks[1]["got"]) and ranks[0]["got"] and ranks[1]["got"]
