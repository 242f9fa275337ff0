"""HF Qwen3-MoE vs the Megatron-Core model loaded through the mapping: same logits, and
the weights exported back from the sharded model are bitwise the checkpoint's; for the `local`
spec under every layout, and the `torch` spec (grouped experts) where its experts shard differently."""

import json

import pytest

from conftest import LAYOUTS, plan_layout_job

TOLERANCE = 1e-4
plan_layout_job("parity", "parity", LAYOUTS)  # 4 sequences of 16 tokens (gspo_mcore.megatron.parity.run)
TORCH_SPEC_LAYOUTS = ["single", "EP2", "TP2-SP-ETP2"]  # all experts on one rank, split over EP, over expert TP
plan_layout_job("parity_torch", "parity", TORCH_SPEC_LAYOUTS, ["model.spec=torch"])
CASES = [("local", layout) for layout in LAYOUTS] + [("torch", layout) for layout in TORCH_SPEC_LAYOUTS]


@pytest.mark.parametrize("spec, layout", CASES)
def test_logits_match_hf(layout_output, spec, layout):
    nproc, _ = LAYOUTS[layout]
    figures = json.loads((layout_output(layout, "parity" if spec == "local" else "parity_torch")
                          / "figures.json").read_text())
    assert f"world={nproc}" in figures["layout"]
    # The comparison is meaningful only if logits are of order one.
    assert figures["logit_std"] > 0.3
    assert figures["max_abs_logit_diff"] <= TOLERANCE, figures
    assert figures["top1_agreement"] == 1.0, figures
    # HF -> sharded Megatron -> gathered HF tensors is bitwise the checkpoint.
    assert figures["export_bitwise_identical"] is True
