"""HF Qwen3-MoE vs the Megatron-Core model loaded through the mapping: same logits, and
the weights exported back from the sharded model are bitwise the checkpoint's."""

import json

import pytest

from conftest import LAYOUTS, plan_layout_job

TOLERANCE = 1e-4
plan_layout_job("parity", "parity", LAYOUTS)  # 4 sequences of 16 tokens (gspo_mcore.megatron.parity.run)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_match_hf(layout_output, layout):
    nproc, _ = LAYOUTS[layout]
    figures = json.loads((layout_output(layout, "parity") / "figures.json").read_text())
    assert f"world={nproc}" in figures["layout"]
    # The comparison is meaningful only if logits are of order one.
    assert figures["logit_std"] > 0.3
    assert figures["max_abs_logit_diff"] <= TOLERANCE, figures
    assert figures["top1_agreement"] == 1.0, figures
    # HF -> sharded Megatron -> gathered HF tensors is bitwise the checkpoint.
    assert figures["export_bitwise_identical"] is True
