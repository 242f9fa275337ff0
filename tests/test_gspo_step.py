"""The GSPO loss in Megatron's schedule is exactly the global minibatch loss, whatever the
layout: 1 rank x 4 microbatches, DP=2 x 2, PP=2, EP=2, TP=2+SP give the loss, gradient norm
and updated weights of the same step taken by the Hugging Face model with policy_loss."""

import functools
import math

import pytest
import torch

from checkpoint_convert.safetensors_io import HFCheckpointReader
from conftest import LAYOUTS, plan_layout_job
from gspo_mcore.loss import aggregate, kl_penalty, policy_loss

ADAM = dict(lr=1.0, eps=1.0)  # first step w - g / (|g| + 1): the weights compare gradients
CLIP = 0.005  # a band the noisy old log-probs below fall on both sides of
KL_COEF = 0.5
CASES = {  # name -> (level, aggregation, KL coefficient, layouts)
    "gspo": ("sequence", None, 0.0, ["single", "DP2", "PP2", "EP2", "TP2-SP"]),
    "token-mean": ("token", "token-mean", 0.0, ["single", "DP2"]),
    "gspo-kl": ("sequence", None, KL_COEF, ["DP2"]),
}


def options(level, aggregation, kl_coef):
    opts = ["optimizer.name=adam", f"optimizer.lr={ADAM['lr']}", f"optimizer.adam_eps={ADAM['eps']}",
            "optimizer.clip_grad=1e6", f"loss.level={level}", f"loss.clip_low={CLIP}", f"loss.clip_high={CLIP}",
            f"loss.kl_loss_coef={kl_coef}"]
    return opts + ([f"loss.aggregation={aggregation}"] if aggregation else [])


@functools.cache
def rollout_batch(hf_dir) -> dict:
    """8 sequences of 17 tokens: a prompt, then a response of varying length (one empty),
    with 'engine' log-probs = the model's own plus noise, and per-sequence advantages."""
    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, 256, (8, 17), generator=g)
    prompt = torch.tensor([3, 5, 4, 6, 3, 5, 4, 6])
    response = torch.tensor([12, 4, 9, 0, 13, 7, 11, 2])
    position = torch.arange(16)[None, :]  # position t predicts token t + 1
    mask = ((position >= prompt[:, None] - 1) & (position < prompt[:, None] - 1 + response[:, None])).float()
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        logp = model(input_ids=tokens[:, :-1]).logits.log_softmax(-1).gather(-1, tokens[:, 1:, None])[..., 0]
    old = logp + 0.03 * torch.randn(logp.shape, generator=g)
    advantages = torch.randn(8, generator=g)
    ref = logp + 0.1 * torch.randn(logp.shape, generator=g)  # a reference policy for the KL case
    return {"tokens": tokens, "old_logprobs": old, "advantages": advantages, "mask": mask, "ref_logprobs": ref}


def _plan_jobs():
    for case, (level, aggregation, kl_coef, layouts) in CASES.items():
        plan_layout_job(f"gspo_step-{case}", "train_step", layouts, options(level, aggregation, kl_coef),
                        batch=rollout_batch)


_plan_jobs()


def hf_step(hf_dir, batch, level, aggregation, kl_coef, out_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    tokens = batch["tokens"]
    logp = model(input_ids=tokens[:, :-1]).logits.log_softmax(-1).gather(-1, tokens[:, 1:, None])[..., 0]
    loss, metrics = policy_loss(logp, batch["old_logprobs"], batch["advantages"], batch["mask"], level=level,
                                clip_low=CLIP, clip_high=CLIP, aggregation=aggregation)
    if kl_coef:
        kl = kl_penalty(logp, batch["ref_logprobs"], "k3")
        loss = loss + kl_coef * aggregate(kl, batch["mask"], aggregation or "seq-mean-token-mean")
    loss.backward()
    grad_norm = math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in model.parameters()))
    torch.optim.Adam(model.parameters(), lr=ADAM["lr"], eps=ADAM["eps"]).step()
    model.save_pretrained(out_dir)
    reader = HFCheckpointReader(out_dir)
    return loss.item(), grad_norm, metrics, {name: reader[name] for name in reader.keys()}


@pytest.mark.parametrize("case, layout", [(c, l) for c, (*_, ls) in CASES.items() for l in ls])
def test_gspo_step_is_layout_invariant(tiny_hf_dir, layout_output, tmp_path, case, layout):
    level, aggregation, kl_coef, _ = CASES[case]
    ref_loss, ref_norm, metrics, ref_weights = hf_step(tiny_hf_dir, rollout_batch(tiny_hf_dir), level, aggregation,
                                                       kl_coef, tmp_path / "hf")
    if level == "sequence":  # the band really splits the batch, so clipping is exercised
        assert 0 < metrics["clip_fraction_sequences"] < 1
    nproc, _ = LAYOUTS[layout]
    out = layout_output(layout, f"gspo_step-{case}")
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(nproc)]
    losses = [r["loss"] for r in ranks if r["loss"] is not None]
    assert losses and all(abs(loss - ref_loss) < 1e-6 for loss in losses), (losses, ref_loss)
    for r in ranks:
        assert r["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)
        for name, tensor in r["weights"].items():
            torch.testing.assert_close(tensor, ref_weights[name], atol=1e-6, rtol=0, msg=name)
