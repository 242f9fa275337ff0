"""The trainer's GSPO update (gspo_mcore.megatron.learner.Learner.update: packing by a token budget,
equal microbatch counts over DP ranks, the Megatron schedule, the exact global normalisation)
is the global minibatch loss's step, whatever the layout: 1 rank x 7 microbatches, DP=2 with
4 and 3 microbatches, PP=2, EP=2 (uneven counts: an all-to-all hang before fillers), TP=2+SP
give the loss, gradient norm and updated weights of the same step taken by the Hugging Face
model with the same loss composition (gspo_mcore.gspo.loss.objective). The KL case uses the trainer's own reference model (the initial
weights); the entropy case the vocabulary-parallel entropy gradient."""

import functools
import math

import pytest
import torch

from gspo_mcore.common.safetensors_io import HFCheckpointReader
from conftest import LAYOUTS, plan_layout_job
from gspo_mcore.config import load_config
from gspo_mcore.gspo.loss import Normalizer, objective

ADAM = dict(lr=1.0, eps=1.0)  # first step w - g / (|g| + 1): the weights compare gradients
CLIP = 0.005  # a band the noisy old log-probs below fall on both sides of
KL_COEF = 0.5
ENTROPY_COEF = 0.1
TOKEN_BUDGET = 20  # 7 microbatches on one rank; 4 and 3 on two DP ranks (asserted below)
HORIZON = 16
CASES = {  # name -> (loss.function, aggregation, KL coefficient, entropy coefficient, layouts)
    "gspo": ("gspo", None, 0.0, 0.0, ["single", "DP2", "PP2", "EP2", "TP2-SP"]),
    "token-mean": ("grpo", "token-mean", 0.0, 0.0, ["single", "DP2"]),
    "gspo-kl": ("gspo", None, KL_COEF, 0.0, ["DP2"]),
    "gspo-entropy-sum-norm": ("gspo", "seq-mean-token-sum-norm", 0.0, ENTROPY_COEF, ["TP2-SP"]),
    # The first minibatch takes pi_old from its own forward: the step of the exactly on-policy loss.
    "gspo-on-policy-first": ("gspo", None, 0.0, 0.0, ["DP2"]),
    # Full activation recompute (every GPU config's): each layer recomputed in backward, same step.
    "gspo-recompute-full": ("gspo", None, 0.0, 0.0, ["EP2"]),
    # Multi-turn trajectories: environment tokens inside responses (loss mask 0) get no gradient
    # and do not count in the length normalisation, on the trainer as in the reference.
    "gspo-multiturn": ("gspo", None, 0.0, 0.0, ["DP2", "EP2"]),
}
# Extra config overrides of a case (beyond the loss's).
CASE_OPTIONS = {"gspo-recompute-full": ["model.recompute=full"]}


def options(function, aggregation, kl_coef, entropy_coef, on_policy=False):
    opts = ["optimizer.name=adam", f"optimizer.lr={ADAM['lr']}", f"optimizer.adam_eps={ADAM['eps']}",
            "optimizer.clip_grad=1e6", f"loss.function={function}", f"loss.clip_low={CLIP}", f"loss.clip_high={CLIP}",
            f"loss.kl_loss_coef={kl_coef}", "loss.kl_estimator=k1", f"loss.entropy_coef={entropy_coef}",
            f"loss.horizon={HORIZON}", "train.num_minibatches=1", f"train.max_tokens_per_microbatch={TOKEN_BUDGET}"]
    # The engine-ratio loss as written (one minibatch: band_from_mismatch never applies).
    opts.append(f"loss.on_policy_first_minibatch={'true' if on_policy else 'false'}")
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
    return {"tokens": tokens, "old_logprobs": old, "advantages": advantages, "mask": mask,
            "prompt_lengths": prompt, "response_lengths": response}


@functools.cache
def multiturn_batch(hf_dir) -> dict:
    """rollout_batch with environment tokens: in each response of 8+ tokens, its tokens 3..5
    were inserted by an environment between two model turns (`loss_mask` 0 there)."""
    batch = dict(rollout_batch(hf_dir))
    mask, loss_masks = batch["mask"].clone(), []
    for i, (p, r) in enumerate(zip(batch["prompt_lengths"].tolist(), batch["response_lengths"].tolist())):
        loss_mask = [0.0 if r >= 8 and 3 <= t <= 5 else 1.0 for t in range(r)]
        mask[i, p - 1:p - 1 + r] = torch.tensor(loss_mask)
        loss_masks.append(loss_mask)
    return {**batch, "mask": mask, "loss_mask": loss_masks}


CASE_BATCH = {"gspo-multiturn": multiturn_batch}


def _plan_jobs():
    for case, (function, aggregation, kl_coef, entropy_coef, layouts) in CASES.items():
        plan_layout_job(f"gspo_step-{case}", "train_step", layouts,
                        [*options(function, aggregation, kl_coef, entropy_coef, on_policy=case.endswith("on-policy-first")),
                         *CASE_OPTIONS.get(case, [])],
                        batch=CASE_BATCH.get(case, rollout_batch))


_plan_jobs()


def test_the_token_budget_gives_data_parallel_ranks_unequal_microbatch_counts():
    from gspo_mcore.gspo.packing import balance_across_ranks, pack_microbatches

    lengths = [p + r - 1 for p, r in zip([3, 5, 4, 6, 3, 5, 4, 6], [12, 4, 9, 0, 13, 7, 11, 2])]
    shards = balance_across_ranks(list(range(8)), lengths, 2)
    assert sorted(len(pack_microbatches(s, lengths, TOKEN_BUDGET)) for s in shards) == [3, 4]
    assert len(pack_microbatches(list(range(8)), lengths, TOKEN_BUDGET)) == 7


def hf_step(hf_dir, batch, function, aggregation, kl_coef, entropy_coef, out_dir, on_policy=False):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    tokens = batch["tokens"]
    log_p = model(input_ids=tokens[:, :-1]).logits.log_softmax(-1)
    logp = log_p.gather(-1, tokens[:, 1:, None])[..., 0]
    # The trainer's own composition of the loss (gspo_mcore.gspo.loss.objective) on transformers' log-probs;
    # pi_ref: the initial weights, i.e. this model before the step.
    cfg = load_config(None, options(function, aggregation, kl_coef, entropy_coef, on_policy)).loss
    loss, metrics = objective(logp, {**batch, "ref_logprobs": logp.detach()}, cfg, Normalizer(horizon=HORIZON),
                              on_policy=on_policy, entropy=-(log_p.exp() * log_p).sum(-1) if entropy_coef else None)
    loss.backward()
    grad_norm = math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in model.parameters()))
    torch.optim.Adam(model.parameters(), lr=ADAM["lr"], eps=ADAM["eps"]).step()
    model.save_pretrained(out_dir)
    reader = HFCheckpointReader(out_dir)
    return loss.item(), grad_norm, metrics, {name: reader[name] for name in reader.keys()}


@pytest.mark.parametrize("case, layout", [(c, l) for c, (*_, ls) in CASES.items() for l in ls])
def test_gspo_step_is_layout_invariant(tiny_hf_dir, layout_output, tmp_path, case, layout):
    function, aggregation, kl_coef, entropy_coef, _ = CASES[case]
    batch = CASE_BATCH.get(case, rollout_batch)(tiny_hf_dir)
    ref_loss, ref_norm, metrics, ref_weights = hf_step(tiny_hf_dir, {k: v for k, v in batch.items() if k != "loss_mask"},
                                                       function, aggregation,
                                                       kl_coef, entropy_coef, tmp_path / "hf",
                                                       on_policy=case.endswith("on-policy-first"))
    if function == "gspo" and not case.endswith("on-policy-first"):  # the band splits the batch: clipping exercised
        assert 0 < metrics["clip_fraction_sequences"] < 1
    nproc, _ = LAYOUTS[layout]
    out = layout_output(layout, f"gspo_step-{case}")
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(nproc)]
    losses = [r["loss"] for r in ranks if r["loss"] is not None]
    assert losses and all(abs(loss - ref_loss) < 1e-6 for loss in losses), (losses, ref_loss)
    for r in ranks:
        assert r["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)
        # The reported figures are the loss's own, combined over microbatches and ranks.
        for key in ("clip_fraction", "clip_fraction_low", "clip_fraction_high", "ratio_mean", "ratio_max"):
            assert r["metrics"][key] == pytest.approx(metrics[key].item(), abs=1e-6), key
        if not case.endswith("on-policy-first"):  # the mismatch is against the engine's log-probs
            assert r["metrics"]["mismatch_abs_log_ratio_mean"] == pytest.approx(metrics["abs_log_ratio_mean"].item(),
                                                                                abs=1e-6)
        for name, tensor in r["weights"].items():
            torch.testing.assert_close(tensor, ref_weights[name], atol=1e-6, rtol=0, msg=name)
