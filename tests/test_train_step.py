"""A forward+backward+optimizer step (Megatron DDP + get_megatron_optimizer, real 1F1B
schedule) under each parallel layout gives the same loss, gradient norm and updated weights
as the same SGD step taken by the Hugging Face model on the same global batch."""

import functools
import math

import pytest
import torch
import torch.nn.functional as F

from gspo_mcore.common.safetensors_io import HFCheckpointReader
from conftest import LAYOUTS, plan_layout_job

# Adam's first step is w - lr * g / (|g| + eps). With eps = 1 it is a smooth function of the
# gradient (not ~sign(g), which would amplify float noise), so updated weights compare gradients.
ADAM = dict(lr=1.0, eps=1.0)
OPTIMIZER = ["optimizer.name=adam", f"optimizer.lr={ADAM['lr']}", f"optimizer.adam_eps={ADAM['eps']}",
             "optimizer.clip_grad=1e6"]


@functools.cache
def global_batch(hf_dir) -> dict:
    return {"tokens": torch.randint(0, 256, (8, 17), generator=torch.Generator().manual_seed(3))}


plan_layout_job("train_step", "train_step", LAYOUTS, OPTIMIZER, batch=global_batch)
# model.spec torch (grouped experts) under the layouts that split the experts
TORCH_LAYOUTS = ["EP2", "TP2-SP-ETP2"]
plan_layout_job("train_step_torch", "train_step", TORCH_LAYOUTS, [*OPTIMIZER, "model.spec=torch"], batch=global_batch)


@pytest.fixture(scope="module")
def hf_reference(tiny_hf_dir, tmp_path_factory):
    """The same step by transformers + torch Adam: loss, grad norm, updated weights (HF names)."""
    from transformers import AutoModelForCausalLM

    tokens = global_batch(tiny_hf_dir)["tokens"]
    model = AutoModelForCausalLM.from_pretrained(tiny_hf_dir, dtype=torch.float32)
    logits = model(input_ids=tokens[:, :-1]).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    loss.backward()
    grad_norm = math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in model.parameters()))
    torch.optim.Adam(model.parameters(), lr=ADAM["lr"], eps=ADAM["eps"]).step()
    out = tmp_path_factory.mktemp("hf_after_step")
    model.save_pretrained(out)  # writes the on-disk (per-expert) names
    reader = HFCheckpointReader(out)
    return loss.item(), grad_norm, {name: reader[name] for name in reader.keys()}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_step_matches_hf(tiny_hf_dir, hf_reference, layout_output, layout, job="train_step"):
    nproc, _ = LAYOUTS[layout]
    out = layout_output(layout, job)
    ref_loss, ref_grad_norm, ref_weights = hf_reference
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(nproc)]
    losses = [r["loss"] for r in ranks if r["loss"] is not None]
    assert losses and all(abs(loss - ref_loss) < 1e-5 for loss in losses), (losses, ref_loss)
    for r in ranks:
        assert r["grad_norm"] == pytest.approx(ref_grad_norm, rel=1e-5)

    seen = set()
    for r in ranks:
        for name, tensor in r["weights"].items():
            seen.add(name)
            torch.testing.assert_close(tensor, ref_weights[name], atol=2e-6, rtol=0, msg=name)
    assert seen == set(ref_weights)  # together the ranks hold every tensor of the model
    # The step moved the weights (a no-op step would match only if gradients were ~0).
    before = HFCheckpointReader(tiny_hf_dir)
    moved = max((ref_weights[n] - before[n]).abs().max().item() for n in ref_weights)
    assert moved > 1e-3


@pytest.mark.parametrize("layout", TORCH_LAYOUTS)
def test_a_step_with_grouped_experts_matches_hf(tiny_hf_dir, hf_reference, layout_output, layout):
    """Gradients through model.spec torch's grouped experts, Megatron's DDP and optimizer:
    transformers' step, as for the `local` spec."""
    test_step_matches_hf(tiny_hf_dir, hf_reference, layout_output, layout, job="train_step_torch")
