"""The GSPO lineage (SAPO, GMPO, LUSPO, CISPO) and the train-inference mismatch correction
(token TIS, sequence MIS), in float64 to 1e-10: each loss's value and gradient against its
paper's equation written with loops, against a peer's published implementation transcribed
here (verl's core_algos.py, TRL's GRPOTrainer), equal to GSPO where its paper says it reduces
to it; the config refusals. Training each one: the slow tests at the end."""

import math
import time

import pytest
import torch

from gspo_mcore.config import ConfigError, LossConfig, load_config
from gspo_mcore.gspo.loss import (LOSSES, AGGREGATIONS, LossInputs, Normalizer, engine_mismatch, mismatch_weight,
                             objective, policy_loss)

LINEAGE = ("sapo", "gmpo", "luspo", "cispo")
WIDE = 0.1  # a GSPO band both branches of the clip see on make_batch's ratios


def make_batch(seed=0, B=6, T=9, spread=0.3, per_token_adv=False):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([9, 1, 5, 7, 3, 8])[:B]
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logp = (old + spread * torch.randn(B, T, generator=g, dtype=torch.float64)).requires_grad_(True)
    adv = torch.randn((B, T) if per_token_adv else (B,), generator=g, dtype=torch.float64)
    return logp, old, adv, mask


def call(name, logp, old, adv, mask, cfg=None, normalizer=Normalizer(), weight=None, clip=(WIDE, WIDE)):
    """A built-in by name, as the objective calls it; returns (loss, gradient wrt logp, metrics)."""
    cfg = cfg or LossConfig(function=name)
    inputs = LossInputs(logp, old, old, adv, mask, clip[0], clip[1], normalizer, None, weight)
    loss, metrics = LOSSES[name](inputs, cfg)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss, grad, metrics


def close(a, b, tol=1e-10):
    return torch.allclose(a, b, atol=tol, rtol=0)


# ---------------------------------------------------------------- the papers' equations, with loops
def lengths_of(mask):
    return [int(mask[i].sum()) for i in range(mask.shape[0])]


def sapo_paper(logp, old, adv, mask, tau_pos=1.0, tau_neg=1.05):
    """SAPO eq. 5-6 / 10-12: -(1/G) sum_i (1/|y_i|) sum_t f(r_it) A_it, f(r) = sigma(tau (r-1)) 4/tau."""
    total = 0
    for i, n in enumerate(lengths_of(mask)):
        if n:
            terms = 0
            for t in range(n):
                a = adv[i, t] if adv.dim() == 2 else adv[i]
                tau = tau_pos if a > 0 else tau_neg
                r = torch.exp(logp[i, t] - old[i, t])
                terms = terms + 4 / tau / (1 + torch.exp(-tau * (r - 1))) * a
            total = total + terms / n
    return -total / mask.shape[0]


def gmpo_paper(logp, old, adv, mask, eps=0.4):
    """GMPO: -(1/G) sum_i (prod_t min(r^s, clip(r^s, e^-eps, e^eps))^s)^(1/|y_i|) A_i, s = sgn A_i."""
    total = 0
    for i, n in enumerate(lengths_of(mask)):
        if n:
            s = 1.0 if adv[i] > 0 else -1.0
            product = 1
            for t in range(n):
                r_s = torch.exp(logp[i, t] - old[i, t]) ** s
                product = product * torch.minimum(r_s, torch.clamp(r_s, math.exp(-eps), math.exp(eps))) ** s
            total = total + product ** (1 / n) * adv[i]
    return -total / mask.shape[0]


def gspo_term(logp, old, adv, mask, i, n, eps_low, eps_high):
    s_i = torch.exp(sum(logp[i, t] - old[i, t] for t in range(n)) / n)  # GSPO eq. 7
    return torch.minimum(s_i * adv[i], torch.clamp(s_i, 1 - eps_low, 1 + eps_high) * adv[i])  # eq. 5


def luspo_paper(logp, old, adv, mask, eps_low=WIDE, eps_high=WIDE):
    """LUSPO: -(1/G) sum_i |y_i| min(s_i A_i, clip(s_i) A_i)."""
    return -sum(n * gspo_term(logp, old, adv, mask, i, n, eps_low, eps_high)
                for i, n in enumerate(lengths_of(mask)) if n) / mask.shape[0]


def cispo_paper(logp, old, adv, mask, w_max=5.0, w_min=None):
    """CISPO eq. 4-5: -(1 / sum_i |o_i|) sum_i sum_t sg(clip(r_it, w_min, w_max)) A_it log pi_theta."""
    total, tokens = 0, 0
    for i, n in enumerate(lengths_of(mask)):
        for t in range(n):
            a = adv[i, t] if adv.dim() == 2 else adv[i]
            r = torch.exp(logp[i, t] - old[i, t]).detach()
            r = min(r, torch.tensor(w_max, dtype=r.dtype)) if w_min is None else torch.clamp(r, w_min, w_max)
            total = total + r * a * logp[i, t]
            tokens += 1
    return -total / tokens


PAPER = {"sapo": sapo_paper, "gmpo": gmpo_paper, "luspo": luspo_paper, "cispo": cispo_paper}


@pytest.mark.parametrize("name", LINEAGE)
@pytest.mark.parametrize("seed", [1, 2])
def test_value_and_gradient_match_the_papers_equation(name, seed):
    # spread 0.6: every loss sees its clip or gate far from 1 on some tokens (checked below)
    logp, old, adv, mask = make_batch(seed=seed, spread=0.6)
    loss, grad, metrics = call(name, logp, old, adv, mask)
    ref = PAPER[name](logp, old, adv, mask)
    (ref_grad,) = torch.autograd.grad(ref, logp)
    assert loss.dtype == torch.float64
    assert abs(loss.item() - ref.item()) < 1e-10 and close(grad, ref_grad) and grad.abs().sum() > 0
    if name in ("gmpo", "luspo"):
        assert 0 < metrics["clip_fraction"] < 1  # both branches of its clip were taken


@pytest.mark.parametrize("name", ["sapo", "cispo"])
def test_per_token_advantages(name):
    logp, old, adv, mask = make_batch(seed=3, per_token_adv=True)
    loss, grad, _ = call(name, logp, old, adv, mask)
    ref = PAPER[name](logp, old, adv, mask)
    assert abs(loss.item() - ref.item()) < 1e-10 and close(grad, torch.autograd.grad(ref, logp)[0])


@pytest.mark.parametrize("name", ["gmpo", "luspo"])
def test_sequence_losses_refuse_per_token_advantages(name):
    logp, old, adv, mask = make_batch(seed=3, per_token_adv=True)
    with pytest.raises(ValueError, match="one advantage per sequence"):
        call(name, logp, old, adv, mask)


def test_the_papers_hyper_parameters_are_the_configs():
    logp, old, adv, mask = make_batch(seed=4, spread=0.8)
    cfg = LossConfig(function="sapo", sapo_tau_pos=0.5, sapo_tau_neg=2.0)
    assert abs(call("sapo", logp, old, adv, mask, cfg)[0].item()
               - sapo_paper(logp, old, adv, mask, 0.5, 2.0).item()) < 1e-10
    cfg = LossConfig(function="gmpo", gmpo_log_clip=0.1)
    assert abs(call("gmpo", logp, old, adv, mask, cfg)[0].item() - gmpo_paper(logp, old, adv, mask, 0.1).item()) < 1e-10
    cfg = LossConfig(function="cispo", cispo_weight_max=1.2, cispo_weight_min=0.9)
    loss, grad, metrics = call("cispo", logp, old, adv, mask, cfg)
    ref = cispo_paper(logp, old, adv, mask, 1.2, 0.9)
    assert abs(loss.item() - ref.item()) < 1e-10 and close(grad, torch.autograd.grad(ref, logp)[0])
    assert metrics["clip_fraction_high"] > 0 and metrics["clip_fraction_low"] > 0


# ---------------------------------------------------------------- peers' published implementations
def verl_sapo(old, logp, adv, mask, tau_pos=1.0, tau_neg=1.05):
    """verl core_algos.compute_policy_loss_sapo (loss_mode sapo), transcribed: token gates,
    advantages > 0 take tau_pos, seq-mean-token-mean."""
    ratio = torch.exp(torch.clamp(logp - old, -20.0, 20.0))
    taus = torch.where(adv > 0, torch.tensor(tau_pos, dtype=adv.dtype), torch.tensor(tau_neg, dtype=adv.dtype))
    losses = -torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus) * adv
    return ((losses * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()


def verl_geo_mean(old, logp, adv, mask, clip=0.4):
    """verl core_algos.compute_policy_loss_geo_mean (loss_mode geo_mean, GMPO's own code), transcribed:
    sign-aware log-space clip, exp of the masked mean, a plain mean over sequences (without its
    + 1e-8 in the two denominators, which moves the value by ~1e-10)."""
    log_ratio = logp - old
    sign = torch.sign(adv)
    bounded = torch.clamp(log_ratio, -clip, clip)
    clipped = sign * torch.min(sign * log_ratio, sign * bounded)
    lengths = mask.sum(-1)
    ratio = torch.exp((clipped * mask).sum(-1) / lengths)
    seq_adv = (adv * mask).sum(-1) / lengths
    return torch.mean(-seq_adv * ratio)


def verl_cispo(old, logp, adv, mask, low=10.0, high=4.0):
    """verl core_algos.compute_policy_loss_cispo, transcribed: clamp(ratio, 1 - low, 1 + high)
    detached, times A log pi, token-mean (its example sets clip_ratio_low 10: no lower bound)."""
    ratio = torch.exp(torch.clamp(logp - old, -20.0, 20.0))
    losses = -torch.clamp(ratio, 1 - low, 1 + high).detach() * adv * logp
    return (losses * mask).sum() / mask.sum()


def trl_luspo(old, logp, adv, mask, eps_low=WIDE, eps_high=WIDE):
    """TRL GRPOTrainer._compute_loss with loss_type luspo, importance_sampling_level sequence,
    transcribed: (B, 1) per-sequence clipped loss times the response's token count, mean."""
    log_weights = ((logp - old) * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    coef_1 = torch.exp(log_weights)[:, None]
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    per_token_loss = -torch.min(coef_1 * adv[:, None], coef_2 * adv[:, None])
    return (per_token_loss * mask.sum(1, keepdim=True)).mean()


def trl_sapo(old, logp, adv, mask, tau_pos=1.0, tau_neg=1.05):
    """TRL GRPOTrainer._compute_loss with loss_type sapo, transcribed (its grpo/sapo reduction);
    its temperatures, Python floats to torch.where, come out float32: here in the batch's dtype."""
    coef_1 = torch.exp(logp - old)
    a = adv[:, None]
    temperatures = torch.where(a > 0, torch.tensor(tau_pos, dtype=a.dtype), torch.tensor(tau_neg, dtype=a.dtype))
    per_token_loss = -torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures * a
    return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


def trl_gmpo(old, logp, adv, mask, eps=0.4):
    """TRL experimental GMPOTrainer._compute_loss, transcribed: where(A > 0, min, max) on the
    log ratio and its clamp, exp of the masked mean, -coef A, mean."""
    log_ratio = logp - old
    bounded = torch.clamp(log_ratio, -eps, eps)
    clipped = torch.where(adv[:, None] > 0, torch.minimum(log_ratio, bounded), torch.maximum(log_ratio, bounded))
    coef = torch.exp((clipped * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))
    return (-coef * adv).mean()


@pytest.mark.parametrize("name, peer, cfg", [
    ("sapo", lambda o, l, a, m: verl_sapo(o, l, a[:, None].expand_as(m), m), None),
    ("sapo", trl_sapo, None),
    ("gmpo", lambda o, l, a, m: verl_geo_mean(o, l, a[:, None].expand_as(m), m), None),
    ("gmpo", trl_gmpo, None),
    ("luspo", trl_luspo, None),
    ("cispo", lambda o, l, a, m: verl_cispo(o, l, a[:, None].expand_as(m), m), None),
    ("cispo", lambda o, l, a, m: verl_cispo(o, l, a[:, None].expand_as(m), m, low=0.1, high=0.2),
     LossConfig(function="cispo", cispo_weight_min=0.9, cispo_weight_max=1.2)),
])
def test_value_and_gradient_match_a_peers_implementation(name, peer, cfg):
    logp, old, adv, mask = make_batch(seed=5, spread=0.6)
    loss, grad, _ = call(name, logp, old, adv, mask, cfg)
    ref = peer(old, logp, adv, mask)
    assert abs(loss.item() - ref.item()) < 1e-10 and close(grad, torch.autograd.grad(ref, logp)[0])


# ---------------------------------------------------------------- where each reduces to GSPO
def gspo_loss(logp, old, adv, mask, aggregation="seq-mean-token-mean", clip=WIDE):
    loss, _ = policy_loss(logp, old, adv, mask, level="sequence", clip_low=clip, clip_high=clip,
                          aggregation=aggregation)
    return loss, torch.autograd.grad(loss, logp)[0]


def test_gmpo_with_no_token_clipped_is_gspo_unclipped():
    """The geometric mean of the token ratios is GSPO's s_i (eq. 7): with no token past GMPO's
    log-space clip and GSPO's band wide enough, the two are one loss, value and gradient."""
    logp, old, adv, mask = make_batch(seed=6, spread=0.05)
    loss, grad, metrics = call("gmpo", logp, old, adv, mask)
    assert metrics["clip_fraction"] == 0
    ref, ref_grad = gspo_loss(logp, old, adv, mask, clip=10.0)
    assert abs(loss.item() - ref.item()) < 1e-12 and close(grad, ref_grad, 1e-12)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_luspo_is_gspo_scaled_by_length(aggregation):
    """LUSPO is GSPO's term times |y_i|: GSPO aggregated seq-mean-token-sum; with every response
    of length L, L x GSPO (the paper's GSPO)."""
    logp, old, adv, mask = make_batch(seed=7)
    loss, grad, _ = call("luspo", logp, old, adv, mask)
    ref, ref_grad = gspo_loss(logp, old, adv, mask, "seq-mean-token-sum")
    assert abs(loss.item() - ref.item()) < 1e-12 and close(grad, ref_grad, 1e-12)
    mask[:, :5], mask[:, 5:] = 1.0, 0.0
    loss, grad, _ = call("luspo", logp, old, adv, mask)
    ref, ref_grad = gspo_loss(logp, old, adv, mask)
    assert abs(loss.item() - 5 * ref.item()) < 1e-12 and close(grad, 5 * ref_grad, 1e-12)


@pytest.mark.parametrize("name", ["sapo", "cispo", "gmpo", "luspo"])
@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "token-mean"])
def test_on_policy_every_losss_gradient_is_gspos(name, aggregation):
    """At theta = theta_old every ratio is 1: SAPO's gate has slope f'(1) = 1, CISPO's weight is
    1, GMPO's geometric mean is s_i; each gradient is the policy gradient, GSPO's under the same
    aggregation (LUSPO's: seq-mean-token-sum, its own)."""
    logp, _, adv, mask = make_batch(seed=8)
    old = logp.detach()
    cfg = LossConfig(function=name, aggregation=None if name == "luspo" else aggregation)
    _, grad, metrics = call(name, logp, old, adv, mask, cfg)
    _, ref_grad = gspo_loss(logp, old, adv, mask, "seq-mean-token-sum" if name == "luspo" else aggregation)
    assert close(grad, ref_grad, 1e-12) and grad.abs().sum() > 0
    assert metrics["ratio_min"] == metrics["ratio_max"] == 1.0


# ---------------------------------------------------------------- the aggregation and metrics contract
@pytest.mark.parametrize("name", LINEAGE)
def test_the_global_normalizer_splits_every_loss_exactly(name):
    """Microbatch losses with the whole batch's counts sum to the whole-batch loss, and their
    metrics combine (gspo_mcore.metrics.report.combine) to the whole batch's."""
    from gspo_mcore.metrics.report import combine, to_floats

    logp, old, adv, mask = make_batch(seed=9, spread=0.6)
    aggregations = [None] if name == "luspo" else AGGREGATIONS
    for aggregation in aggregations:
        cfg = LossConfig(function=name, aggregation=aggregation)
        whole, _, whole_metrics = call(name, logp, old, adv, mask, cfg)
        norm = Normalizer(num_sequences=6, num_tokens=float(mask.sum()), horizon=9)
        parts = [call(name, logp[s].detach().requires_grad_(), old[s], adv[s], mask[s], cfg, norm)
                 for s in (slice(0, 2), slice(2, 3), slice(3, 6))]
        assert abs(whole.item() - sum(p[0].item() for p in parts)) < 1e-12, aggregation
        combined = combine([to_floats(p[2]) for p in parts])
        for key, value in to_floats(whole_metrics).items():
            assert combined[key] == pytest.approx(value, rel=1e-12, abs=1e-15), (key, aggregation)


def test_every_lineage_figure_is_a_schema_row_and_sapo_reports_no_clip():
    from gspo_mcore.metrics.schema import BY_NAME

    logp, old, adv, mask = make_batch(seed=10)
    for name in LINEAGE:
        for correction in ("none", "token_tis", "sequence_mis"):
            cfg = LossConfig(function=name, mismatch_correction=correction, token_mask_band=[0.5, 2.0])
            _, metrics = objective(logp, {"old_logprobs": old, "engine_logprobs": old + 0.05, "advantages": adv,
                                          "mask": mask}, cfg)
            assert set(metrics) <= set(BY_NAME), set(metrics) - set(BY_NAME)
            assert "token_mask_fraction" in metrics  # the mismatch masks compose with it too
            assert ("clip_fraction" in metrics) == (name != "sapo")


# ---------------------------------------------------------------- the mismatch correction
def correction_batch(seed=11):
    """A step's first minibatch on-policy: pi_old is the trainer's forward, pi_engine differs by
    a bf16-like ~0.05 per token, more on one sequence."""
    logp, _, adv, mask = make_batch(seed=seed, spread=0.0)
    g = torch.Generator().manual_seed(seed + 100)
    engine = logp.detach() + 0.05 * torch.randn(mask.shape, generator=g, dtype=torch.float64)
    engine[3] += 0.4  # sequence 3: the engine much likelier than the trainer
    return logp, engine, adv, mask


def test_token_tis_weights_each_token_by_its_truncated_ratio_on_every_loss():
    logp, engine, adv, mask = correction_batch()
    rho = torch.exp(logp.detach() - engine)
    expected = rho.clamp(max=1.02)
    weight, metrics = mismatch_weight(logp.detach(), engine, mask, "token_tis", 1.02)
    assert close(weight * mask, expected * mask, 1e-15)
    assert metrics["mismatch_truncated_fraction"].item() == pytest.approx(
        ((rho > 1.02) * mask).sum().item() / mask.sum().item(), abs=1e-15)
    assert 0 < metrics["mismatch_truncated_fraction"] < 1
    assert metrics["mismatch_weight_mean"].item() == pytest.approx((expected * mask).sum().item() / mask.sum().item())
    batch = {"old_logprobs": engine, "advantages": adv, "mask": mask}
    for name in LOSSES:
        adv_in = adv[:, None].expand_as(mask) if name == "gspo_token" else adv
        cfg = LossConfig(function=name, mismatch_correction="token_tis", mismatch_threshold=1.02)
        loss, corrected = objective(logp, {**batch, "advantages": adv_in}, cfg, on_policy=True)
        (grad,) = torch.autograd.grad(loss, logp)
        # The same loss with its per-token objective times w, written with the paper's reference.
        plain, _, _ = call(name, logp, logp.detach(), adv_in, mask, LossConfig(function=name), weight=weight,
                           clip=(3e-4, 4e-4))
        assert abs(loss.item() - plain.item()) < 1e-12, name
        assert corrected["mismatch_truncated_fraction"] == metrics["mismatch_truncated_fraction"]
        uncorrected, _ = objective(logp, {**batch, "advantages": adv_in}, LossConfig(function=name), on_policy=True)
        assert abs(loss.item() - uncorrected.item()) > 1e-6, name  # the weights changed it


def test_token_tis_scales_the_papers_terms():
    """One check of the composition against a transcription: SAPO's eq. with each token's term
    times min(rho_t, C)."""
    logp, engine, adv, mask = correction_batch(seed=12)
    cfg = LossConfig(function="sapo", mismatch_correction="token_tis", mismatch_threshold=1.03)
    loss, _ = objective(logp, {"old_logprobs": engine, "advantages": adv, "mask": mask}, cfg, on_policy=True)
    (grad,) = torch.autograd.grad(loss, logp)
    w = torch.exp(logp.detach() - engine).clamp(max=1.03)
    ref = 0
    for i, n in enumerate(lengths_of(mask)):
        if n:
            tau = 1.0 if adv[i] > 0 else 1.05
            ref = ref + sum(w[i, t] * 4 / tau * torch.sigmoid(tau * (torch.exp(logp[i, t] - logp[i, t].detach()) - 1))
                            * adv[i] for t in range(n)) / n
    ref = -ref / mask.shape[0]
    assert abs(loss.item() - ref.item()) < 1e-10 and close(grad, torch.autograd.grad(ref, logp)[0])


def test_sequence_mis_masks_the_sequences_outside_the_band_and_weights_the_rest():
    logp, engine, adv, mask = correction_batch(seed=13)
    weight, metrics = mismatch_weight(logp.detach(), engine, mask, "sequence_mis", 2.0)
    rho = torch.exp(((logp.detach() - engine) * mask).sum(-1))  # the product over the response
    assert rho[3] < 0.5  # sequence 3 is outside [1/2, 2]
    inside = (rho >= 0.5) & (rho <= 2.0)
    assert close(weight[:, 0], torch.where(inside, rho, torch.zeros_like(rho)), 1e-14)
    assert (weight == weight[:, :1]).all()  # one weight per sequence
    assert metrics["mismatch_masked_fraction"].item() == pytest.approx((~inside).sum().item() / 6)
    for name in LINEAGE + ("gspo",):
        cfg = LossConfig(function=name, mismatch_correction="sequence_mis")
        loss, _ = objective(logp, {"old_logprobs": engine, "advantages": adv, "mask": mask}, cfg, on_policy=True)
        (grad,) = torch.autograd.grad(loss, logp)
        assert (grad[3] == 0).all() and (grad[~inside].abs().sum() == 0)
        assert (grad[inside].abs().sum(-1)[mask[inside].sum(-1) > 0] > 0).all(), name


def test_the_correction_is_one_where_pi_old_is_the_engines():
    """A later minibatch without recomputation: pi_old is the engine's, rho = 1; the loss's own
    ratio pi_theta / pi_engine carries the mismatch. The loss is the uncorrected one."""
    logp, engine, adv, mask = correction_batch(seed=14)
    batch = {"old_logprobs": engine, "advantages": adv, "mask": mask}
    for correction in ("token_tis", "sequence_mis"):
        loss, metrics = objective(logp, batch, LossConfig(mismatch_correction=correction))
        plain, _ = objective(logp, batch, LossConfig())
        assert loss.item() == plain.item() and metrics["mismatch_weight_mean"] == 1.0


def test_mismatch_kl_is_the_k3_estimate_of_kl_engine_to_trainer():
    logp, engine, _, mask = correction_batch(seed=15)
    figures = engine_mismatch(logp.detach(), engine, mask, 3e-4, 4e-4)
    d = logp.detach() - engine  # log pi_trainer / pi_engine on the engine's samples
    expected = sum(float(torch.exp(d[i, t]) - 1 - d[i, t]) for i, n in enumerate(lengths_of(mask)) for t in range(n))
    assert figures["mismatch_kl"].item() == pytest.approx(expected / mask.sum().item(), rel=1e-12)
    # The out-of-band share it sits beside is the same measurement, per sequence, against the band.
    s = torch.exp((d * mask).sum(-1) / mask.sum(-1))
    assert figures["mismatch_out_of_band_fraction"].item() == pytest.approx(
        ((s > 1 + 4e-4) | (s < 1 - 3e-4)).double().mean().item())


# ---------------------------------------------------------------- the config
@pytest.mark.parametrize("overrides, message", [
    (["loss.function=sapo", "loss.clip_high=0.2"], r"^loss.clip_high: applies to loss.function gspo, gspo_token, "
                                                   r"grpo, luspo, not sapo$"),
    (["loss.function=cispo", "loss.dual_clip=3"], r"^loss.dual_clip: applies to .* not cispo$"),
    (["loss.function=gspo", "loss.sapo_tau_neg=2"], r"^loss.sapo_tau_neg: applies to loss.function sapo, not gspo$"),
    (["loss.function=sapo", "loss.gmpo_log_clip=0.2"], r"^loss.gmpo_log_clip: applies to loss.function gmpo, "
                                                       r"not sapo$"),
    (["loss.function=grpo", "loss.cispo_weight_max=2"], r"^loss.cispo_weight_max: applies to loss.function cispo, "
                                                        r"not grpo$"),
    (["loss.function=luspo", "loss.aggregation=token-mean"], r"^loss.aggregation: luspo's length scaling is its "
                                                             r"aggregation \(seq-mean-token-sum\): leave it unset$"),
    (["loss.function=sapo", "loss.sapo_tau_pos=0"], r"^loss.sapo_tau_pos: must be > 0$"),
    (["loss.function=cispo", "loss.cispo_weight_min=1.5"], r"^loss.cispo_weight_min / cispo_weight_max: expected "),
    (["loss.mismatch_correction=tis"], r"^loss.mismatch_correction: 'tis' is not one of \['none', 'token_tis', "
                                       r"'sequence_mis'\]$"),
    (["loss.mismatch_threshold=0.5"], r"^loss.mismatch_threshold: must be > 1$"),
    (["loss.mismatch_correction=sequence_mis", "rollout.mode=async"], r"^loss.mismatch_correction: applies in "
                                                                       r"rollout.mode sync"),
])
def test_a_field_for_another_loss_is_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_a_field_left_at_its_default_and_a_users_loss_are_fine():
    # configs/tiny_cpu.yaml writes the default band out: every lineage loss runs on it.
    for name in LINEAGE:
        assert load_config("configs/tiny_cpu.yaml", [f"loss.function={name}"]).loss.function == name
    cfg = load_config(None, ["loss.function=loss_fixtures:reinforce", "loss.sapo_tau_pos=2", "loss.clip_low=0.1"])
    assert cfg.loss.sapo_tau_pos == 2
    assert load_config(None, ["loss.function=cispo", "loss.cispo_weight_max=1.28"]).loss.cispo_weight_max == 1.28


# ---------------------------------------------------------------- training the CPU default (slow)
TRAIN_STEPS = 30  # the fewest where each loss's first 10 -> last 10 steps gain 0.3 with margin (measured)
# These runs measure learning, not exactness (tests/test_exactness.py, test_train_engine.py and
# bench/exactness_soak.py do): strict exactness off, since one of these runs was once stopped by a
# single float32 sequence at |log s| 3.6e-3 whose cause is not yet known (the session note of
# 2026-11-26), and a learning test must not fail on it.
LEARNING_ONLY = ["train.strict_exactness=false"]
# Each loss's paper's hyper-parameters: the `loss` defaults, but for LUSPO's clip band, which is
# GSPO's fields (its paper trained with 2e-3 / 2.5e-3, Sec. 5.1; bench/losses.py's arm too). At
# GSPO's 3e-4 / 4e-4 its gains were 0.53, 0.57, 0.44, 0.55 and once 0.16.
PAPER_BAND = {"luspo": ["loss.clip_low=2e-3", "loss.clip_high=2.5e-3"]}


@pytest.mark.slow
@pytest.mark.xdist_group("train")  # test_train's worker: the session's float32 server, shared
def test_each_lineage_loss_trains_the_cpu_default(toy, server, tmp_path):
    """configs/tiny_cpu.yaml with each lineage loss at its paper's defaults, against one running
    server (each run pushes its initial weights first): mean reward of the last 10 steps at least
    0.3 above the first 10. One test, the four runs in sequence: they share the server and cores."""
    from helpers import metrics, toy_overrides, train

    seconds, gains = {}, {}
    for name in LINEAGE:
        out, began = tmp_path / name, time.monotonic()
        train(out, [*toy_overrides(toy), f"rollout.urls=[{server}]", f"loss.function={name}",
                    f"train.steps={TRAIN_STEPS}", "train.save_every=0", "train.export_hf=false",
                    "weight_sync.check_every=0", "train.log_samples_every=0", *LEARNING_ONLY,
                    *PAPER_BAND.get(name, [])])
        seconds[name] = round(time.monotonic() - began)
        rewards = [row["reward_mean"] for row in metrics(out)]
        assert len(rewards) == TRAIN_STEPS
        gains[name] = sum(rewards[-10:]) / 10 - sum(rewards[:10]) / 10
    print(f"lineage training: gains {gains}, seconds {seconds}")
    assert all(gain >= 0.3 for gain in gains.values()), (gains, seconds)
