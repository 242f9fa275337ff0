"""GSPO / GSPO-token / token-level losses against float64 references written straight from
the paper's formulas (arXiv 2507.18071), with loops instead of vectorised code."""


import pytest
import torch

from gspo_mcore.gspo.loss import AGGREGATIONS, Normalizer, aggregate, kl_penalty, policy_loss

EPS_LOW, EPS_HIGH = 0.2, 0.27  # wide enough that both branches of the clip occur below


def make_batch(seed=0, B=6, T=9, per_token_adv=False):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([9, 1, 5, 7, 3, 8])[:B]
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logp = (old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).requires_grad_(True)
    adv = torch.randn((B, T) if per_token_adv else (B,), generator=g, dtype=torch.float64)
    return logp, old, adv, mask


def reference(logp, old, adv, mask, level, aggregation, dual=None):
    """-J(theta) with per-token terms l[i][t], aggregated as the named mode (float64)."""
    B, T = mask.shape
    lengths = [int(mask[i].sum()) for i in range(B)]
    terms = [[None] * T for _ in range(B)]
    for i in range(B):
        if lengths[i] == 0:
            continue
        # eq. 7: s_i = exp(1/|y_i| sum_t log(pi_theta / pi_old))
        s_i = torch.exp(sum(logp[i, t] - old[i, t] for t in range(lengths[i])) / lengths[i])
        for t in range(lengths[i]):
            a = adv[i, t] if adv.dim() == 2 else adv[i]
            if level == "sequence":
                r = s_i
            elif level == "sequence_token":  # eq. 13
                r = s_i.detach() * torch.exp(logp[i, t] - logp[i, t].detach())
            else:
                r = torch.exp(logp[i, t] - old[i, t])
            clipped = torch.clamp(r, 1 - EPS_LOW, 1 + EPS_HIGH)
            value = torch.minimum(r * a, clipped * a)
            if dual is not None and a < 0:
                value = torch.maximum(value, dual * a)
            terms[i][t] = value
    seq_sums = [sum(terms[i][t] for t in range(lengths[i])) for i in range(B) if lengths[i]]
    seq_means = [sum(terms[i][t] for t in range(lengths[i])) / lengths[i] for i in range(B) if lengths[i]]
    if aggregation == "token-mean":
        J = sum(seq_sums) / sum(lengths)
    elif aggregation == "seq-mean-token-sum":
        J = sum(seq_sums) / B
    elif aggregation == "seq-mean-token-mean":
        J = sum(seq_means) / B
    else:
        J = sum(seq_sums) / (B * T)
    return -J


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("level", ["sequence", "sequence_token", "token"])
def test_values_and_gradients_match_reference(level, aggregation):
    logp, old, adv, mask = make_batch(seed=1)
    loss, _ = policy_loss(logp, old, adv, mask, level=level, clip_low=EPS_LOW, clip_high=EPS_HIGH,
                          aggregation=aggregation)
    (grad,) = torch.autograd.grad(loss, logp)
    ref = reference(logp, old, adv, mask, level, aggregation)
    (ref_grad,) = torch.autograd.grad(ref, logp)
    assert loss.dtype == torch.float64
    assert abs(loss.item() - ref.item()) < 1e-10
    assert torch.allclose(grad, ref_grad, atol=1e-10, rtol=0)
    assert grad.abs().sum() > 0


@pytest.mark.parametrize("level", ["sequence_token", "token"])
def test_per_token_advantages(level):
    logp, old, adv, mask = make_batch(seed=2, per_token_adv=True)
    loss, _ = policy_loss(logp, old, adv, mask, level=level, clip_low=EPS_LOW, clip_high=EPS_HIGH)
    ref = reference(logp, old, adv, mask, level, "seq-mean-token-mean")
    assert abs(loss.item() - ref.item()) < 1e-10


@pytest.mark.parametrize("level", ["sequence", "token"])
def test_dual_clip(level):
    logp, old, adv, mask = make_batch(seed=3)
    with torch.no_grad():
        logp += 2.0  # push ratios far above the band so the dual clip binds for A < 0
    loss, _ = policy_loss(logp, old, adv, mask, level=level, clip_low=EPS_LOW, clip_high=EPS_HIGH, dual_clip=3.0)
    ref = reference(logp, old, adv, mask, level, "seq-mean-token-mean", dual=3.0)
    plain, _ = policy_loss(logp, old, adv, mask, level=level, clip_low=EPS_LOW, clip_high=EPS_HIGH)
    assert abs(loss.item() - ref.item()) < 1e-10 and abs(loss.item() - plain.item()) > 1e-3


def test_gspo_and_gspo_token_same_value_and_gradient():
    logp, old, adv, mask = make_batch(seed=4)
    seq, _ = policy_loss(logp, old, adv, mask, level="sequence", clip_low=EPS_LOW, clip_high=EPS_HIGH)
    tok, _ = policy_loss(logp, old, adv, mask, level="sequence_token", clip_low=EPS_LOW, clip_high=EPS_HIGH)
    (g_seq,) = torch.autograd.grad(seq, logp)
    (g_tok,) = torch.autograd.grad(tok, logp)
    assert abs(seq.item() - tok.item()) < 1e-12
    assert torch.allclose(g_seq, g_tok, atol=1e-12, rtol=0)


def test_paper_defaults_and_metrics():
    logp, old, adv, mask = make_batch(seed=5)
    loss, metrics = policy_loss(logp, old, adv, mask)  # clip 3e-4 / 4e-4: nearly every sequence clipped
    assert 0 < metrics["clip_fraction_sequences"] <= 1
    ratios = torch.exp(((logp - old) * mask).sum(-1) / mask.sum(-1))
    assert abs(metrics["ratio_max"].item() - ratios.max().item()) < 1e-12
    assert abs(metrics["abs_log_ratio_mean"].item() - ratios.log().abs().mean().item()) < 1e-12
    assert metrics["ratio_above_band"] + metrics["ratio_below_band"] <= 1


def test_sequence_metrics_count_only_sequences_with_tokens():
    """Empty responses (a zero mask row) do not count in the per-sequence figures; a batch of
    only empty responses reads ratio 1 and fractions 0."""
    logp, old, adv, mask = make_batch(seed=7)
    mask[1] = 0
    mask[3] = 0
    _, metrics = policy_loss(logp, old, adv, mask)
    kept = mask.sum(-1) > 0
    ratios = torch.exp(((logp - old) * mask).sum(-1)[kept] / mask.sum(-1)[kept])
    assert abs(metrics["ratio_mean"].item() - ratios.mean().item()) < 1e-12
    assert metrics["ratio_min"].item() == ratios.min().item() and metrics["ratio_max"].item() == ratios.max().item()
    assert abs(metrics["ratio_above_band"].item() - (ratios > 1 + 4e-4).double().mean().item()) < 1e-12
    assert abs(metrics["abs_log_ratio_mean"].item() - ratios.log().abs().mean().item()) < 1e-12
    _, empty = policy_loss(logp, old, adv, torch.zeros_like(mask))
    assert empty["ratio_mean"] == empty["ratio_min"] == empty["ratio_max"] == 1.0
    assert empty["abs_log_ratio_mean"] == empty["clip_fraction_sequences"] == empty["ratio_below_band"] == 0


def test_on_policy_ratio_is_one_and_nothing_is_clipped():
    logp, _, adv, mask = make_batch(seed=6)
    loss, metrics = policy_loss(logp, logp.detach(), adv, mask)
    assert metrics["ratio_min"] == metrics["ratio_max"] == 1.0
    assert metrics["clip_fraction_sequences"] == 0 and metrics["clip_fraction"] == 0
    # On policy, d/dtheta of s_i A_i is A_i * mean_t d logp: the policy gradient itself.
    (grad,) = torch.autograd.grad(loss, logp)
    lengths = mask.sum(-1, keepdim=True)
    expected = -(adv[:, None] * mask / lengths) / mask.shape[0]
    assert torch.allclose(grad, expected, atol=1e-12)


def test_empty_response_is_masked_not_nan():
    logp, old, adv, mask = make_batch(seed=7)
    mask[1] = 0
    loss, metrics = policy_loss(logp, old, adv, mask)
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.isfinite(loss) and torch.isfinite(grad).all() and (grad[1] == 0).all()
    assert all(torch.isfinite(v) for v in metrics.values())


def test_response_at_max_length():
    logp, old, adv, mask = make_batch(seed=8)
    mask[:] = 1  # every response fills the whole horizon
    loss, _ = policy_loss(logp, old, adv, mask, clip_low=EPS_LOW, clip_high=EPS_HIGH)
    assert abs(loss.item() - reference(logp, old, adv, mask, "sequence", "seq-mean-token-mean").item()) < 1e-10


def test_huge_log_ratio_is_clamped_not_inf():
    logp, old, adv, mask = make_batch(seed=9)
    with torch.no_grad():
        logp[0] += 500.0
    loss, metrics = policy_loss(logp, old, adv, mask, level="token")
    assert torch.isfinite(loss) and torch.isfinite(metrics["ratio_max"])


def test_nan_in_old_logprobs_names_the_sample():
    logp, old, adv, mask = make_batch(seed=10)
    old[3, 2] = float("nan")
    with pytest.raises(ValueError, match="old_logprobs: non-finite value in sample 3 at token 2"):
        policy_loss(logp, old, adv, mask)
    old[3, 2] = 0.0
    old[1, 5] = float("nan")  # outside sample 1's response (length 1): ignored
    policy_loss(logp, old, adv, mask)


def test_a_deferred_check_names_the_sample_once_read():
    """Inside deferred_input_checks (the trainer's step) the loss notes the check on the device
    and goes on; `raise_if_any` reads every call's note at once, naming the rows' samples."""
    from gspo_mcore.gspo.loss import deferred_input_checks, naming_samples

    logp, old, adv, mask = make_batch(seed=10)
    bad = old.clone()
    bad[3, 2] = float("inf")
    with deferred_input_checks() as checks:
        policy_loss(logp, old, adv, mask)
        with naming_samples(torch.tensor([10, 11, 12, 13, 14, 15])):
            policy_loss(logp, bad, adv, mask)  # no error yet
        assert len(checks.pending) == 2
        with pytest.raises(ValueError, match="old_logprobs: non-finite value in sample 13 at token 2"):
            checks.raise_if_any()
        checks.raise_if_any()  # read and cleared


def test_mismatched_shapes_are_clear_errors():
    logp, old, adv, mask = make_batch(seed=11)
    with pytest.raises(ValueError, match=r"must be the same \[B, T\]"):
        policy_loss(logp, old[:, :5], adv, mask)
    with pytest.raises(ValueError, match=r"advantages \[4\]"):
        policy_loss(logp, old, adv[:4], mask)
    with pytest.raises(ValueError, match="one advantage per sequence"):
        policy_loss(logp, old, torch.zeros_like(old), mask, level="sequence")
    with pytest.raises(ValueError, match="level 'seq'"):
        policy_loss(logp, old, adv, mask, level="seq")


def test_global_normalizer_splits_exactly():
    """Microbatch losses with the whole batch's counts add up to the whole-batch loss."""
    logp, old, adv, mask = make_batch(seed=12)
    for aggregation in AGGREGATIONS:
        whole, _ = policy_loss(logp, old, adv, mask, aggregation=aggregation)
        norm = Normalizer(num_sequences=6, num_tokens=float(mask.sum()), horizon=9)
        parts = sum(policy_loss(logp[s], old[s], adv[s], mask[s], aggregation=aggregation, normalizer=norm)[0]
                    for s in (slice(0, 2), slice(2, 3), slice(3, 6)))
        assert abs(whole.item() - parts.item()) < 1e-12, aggregation


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimators(estimator):
    logp = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64)
    ref = torch.tensor([-1.5, -1.0, -0.5], dtype=torch.float64)
    d = logp - ref
    expected = {"k1": d, "k2": 0.5 * d**2, "k3": torch.exp(-d) + d - 1}[estimator]
    assert torch.allclose(kl_penalty(logp, ref, estimator), expected, atol=1e-15)
    assert (kl_penalty(logp, ref, "k3") >= 0).all()


def test_aggregate_rejects_unknown_mode():
    with pytest.raises(ValueError, match="aggregation 'mean'"):
        aggregate(torch.zeros(2, 2), torch.ones(2, 2), "mean")


def test_token_mask_drops_tokens_outside_the_band_from_ratio_and_gradient():
    """IcePop-style: a token whose pi_theta / pi_engine leaves [low, high] gives no gradient and
    leaves the sequence ratio; the rest is the loss of the batch without it."""
    logp, old, adv, mask = make_batch(seed=21)
    logp = old + 0.1 * (logp.detach() - old)  # every other token well inside the band
    logp[0, 2] = old[0, 2] + 2.0  # ratio e^2 ~ 7.4: outside [0.5, 5]
    logp[3, 1] = old[3, 1] - 1.0  # ratio e^-1 ~ 0.37: outside
    logp.requires_grad_(True)
    band = (0.5, 5.0)
    loss, metrics = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2, token_mask_band=band)
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad[0, 2] == 0 and grad[3, 1] == 0 and grad[0, 3] != 0
    inside = mask.clone()
    inside[0, 2] = inside[3, 1] = 0
    expected, _ = policy_loss(logp, old, adv, inside, clip_low=0.2, clip_high=0.2,
                              normalizer=Normalizer(num_sequences=6, num_tokens=float(mask.sum())))
    assert abs(loss.item() - expected.item()) < 1e-12
    assert metrics["token_mask_fraction"].item() == pytest.approx(2 / mask.sum().item())


def test_sequence_mask_drops_only_negative_sequences_the_policy_moved_away_from():
    """DeepSeek-V3.2: A < 0 and mean log(pi_engine / pi_theta) > delta -> no gradient."""
    logp, old, adv, mask = make_batch(seed=22)
    adv = torch.tensor([-1.0, 1.0, -1.0, -1.0, 1.0, 0.5], dtype=torch.float64)
    logp = old.clone()
    logp[0] -= 0.5  # far below the engine, negative advantage: masked
    logp[1] -= 0.5  # far below, positive advantage: kept
    logp[2] += 0.5  # above the engine: kept
    logp.requires_grad_(True)
    loss, metrics = policy_loss(logp, old, adv, mask, clip_low=10, clip_high=10, sequence_mask_threshold=0.1)
    (grad,) = torch.autograd.grad(loss, logp)
    per_sequence = grad.abs().sum(-1)
    assert per_sequence[0] == 0 and (per_sequence[1:] > 0).all()
    assert metrics["sequence_mask_fraction"].item() == pytest.approx(1 / 6)
    _, off = policy_loss(logp, old, adv, mask)
    assert "sequence_mask_fraction" not in off and "token_mask_fraction" not in off


def _async_batch(seed=0, B=6, T=9):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, T, generator=g) > 0.2).float()
    mask[2] = 0.0  # an empty response
    prox = -torch.rand(B, T, generator=g) * 3
    return {"old_logprobs": prox, "engine_logprobs": prox + 0.3 * torch.randn(B, T, generator=g),
            "advantages": torch.randn(B, generator=g), "mask": mask}


def test_decoupled_gspo_with_nothing_stale_is_the_synchronous_loss():
    """max_staleness 0 in effect: no stale token, every behaviour weight exactly 1, the same loss
    and gradient as the synchronous objective."""
    from gspo_mcore.config import LossConfig
    from gspo_mcore.gspo.loss import objective

    batch, cfg = _async_batch(), LossConfig(clip_low=0.05, clip_high=0.05)
    logp = (batch["old_logprobs"] + 0.02 * torch.randn(batch["mask"].shape)).requires_grad_()
    sync_loss, _ = objective(logp, batch, cfg)
    (sync_grad,) = torch.autograd.grad(sync_loss, logp)
    loss, metrics = objective(logp, {**batch, "stale": torch.zeros_like(batch["mask"])}, cfg)
    (grad,) = torch.autograd.grad(loss, logp)
    assert loss.item() == sync_loss.item() and torch.equal(grad, sync_grad)
    assert metrics["behavior_weight_mean"].item() == 1.0 and metrics["behavior_weight_truncated_fraction"].item() == 0


def test_the_behaviour_weight_is_the_length_normalised_stale_ratio_truncated():
    from gspo_mcore.config import LossConfig
    from gspo_mcore.gspo.loss import behavior_weight, objective

    batch = _async_batch(seed=1)
    stale = torch.zeros_like(batch["mask"])
    stale[:, :4] = 1.0  # the first tokens came from the previous weights
    weight, metrics = behavior_weight(batch["old_logprobs"], batch["engine_logprobs"], stale, batch["mask"], cap=1.2)
    mask = batch["mask"]
    expected = (((batch["old_logprobs"] - batch["engine_logprobs"]) * mask * stale).sum(-1)
                / mask.sum(-1).clamp(min=1)).exp().clamp(max=1.2)
    torch.testing.assert_close(weight, expected)
    assert weight[2].item() == 1.0  # no tokens, no weight
    kept = mask.sum(-1) > 0
    assert metrics["behavior_weight_truncated_fraction"].item() == pytest.approx(
        ((expected >= 1.2) & kept).sum().item() / kept.sum().item())
    # In the loss: the advantage of each sequence scaled by its weight.
    logp = batch["old_logprobs"] + 0.01
    cfg = LossConfig(clip_low=0.05, clip_high=0.05, behavior_weight_cap=1.2)
    loss, _ = objective(logp, {**batch, "stale": stale}, cfg)
    scaled, _ = objective(logp, {**batch, "advantages": batch["advantages"] * expected}, cfg)
    assert loss.item() == pytest.approx(scaled.item(), rel=1e-12)


def test_the_asynchronous_mismatch_is_measured_on_the_current_versions_tokens():
    """On tokens an older version generated, trainer vs engine differ by the policy's own change
    too: the mismatch (which sizes the later minibatches' band, loss.band_from_mismatch) is taken
    on the current version's tokens, so it stays the train-inference mismatch of sync."""
    from gspo_mcore.config import LossConfig
    from gspo_mcore.gspo.loss import engine_mismatch, objective

    batch = _async_batch(seed=2)
    stale = torch.zeros_like(batch["mask"])
    stale[:3, :5] = 1.0
    drifted = {**batch, "engine_logprobs": batch["engine_logprobs"] + 2.0 * stale, "stale": stale}
    _, metrics = objective(batch["old_logprobs"], drifted, LossConfig())
    expected = engine_mismatch(batch["old_logprobs"], batch["engine_logprobs"], batch["mask"] * (1 - stale), 3e-4, 4e-4)
    assert metrics["mismatch_abs_log_ratio_mean"].item() == pytest.approx(expected["mismatch_abs_log_ratio_mean"].item())
    assert metrics["mismatch_abs_log_ratio_mean"].item() < 0.5  # the 2.0 drift is not in it


def test_the_asynchronous_mismatch_combines_over_its_own_tokens_and_is_null_without_them():
    """Split into microbatches (and ranks), the mismatch of the current version's tokens combines
    by their own counts: a microbatch with only stale sequences adds nothing (it used to count as
    a mismatch of 0 weighted by all its sequences, shrinking the band in proportion to the stale
    share), and a first minibatch with no current-version token measures nothing (null), never 0,
    so the band keeps the latest measurement (gspo_mcore.megatron.learner)."""
    from gspo_mcore.config import LossConfig
    from gspo_mcore.gspo.loss import objective
    from gspo_mcore.metrics.report import combine, to_floats

    batch = _async_batch(seed=5, B=8)
    stale = torch.zeros_like(batch["mask"])
    stale[:4] = 1.0  # the first four sequences stale throughout
    stale[5, :3] = 1.0  # one spanning two versions
    full = {**batch, "stale": stale}
    _, whole = objective(batch["old_logprobs"], full, LossConfig())
    parts = [to_floats(objective(batch["old_logprobs"][s], {k: v[s] for k, v in full.items()}, LossConfig())[1])
             for s in (slice(0, 4), slice(4, 6), slice(6, 8))]
    combined = combine(parts)
    fresh_sequences = ((batch["mask"] * (1 - stale)).sum(-1) > 0).sum().item()
    assert combined["mismatch_num_sequences"] == whole["mismatch_num_sequences"].item() == fresh_sequences == 4
    for key in ("mismatch_abs_log_ratio_mean", "mismatch_abs_log_ratio_max", "mismatch_token_abs_log_ratio_mean",
                "mismatch_out_of_band_fraction"):
        assert combined[key] == pytest.approx(whole[key].item(), rel=1e-6), key  # float32 sums
    assert combined["mismatch_abs_log_ratio_mean"] > 0.05
    # Only stale tokens: nothing measured.
    none = combine([to_floats(objective(batch["old_logprobs"][s], {k: v[s] for k, v in full.items()},
                                        LossConfig())[1]) for s in (slice(0, 2), slice(2, 4))])
    assert none["mismatch_num_sequences"] == 0 and none["num_sequences"] == 3
    assert none["mismatch_abs_log_ratio_mean"] is None and none["mismatch_abs_log_ratio_max"] is None


def test_free_proximal_policy_is_exact_on_the_first_minibatch_and_the_engine_after():
    """loss.proximal first_minibatch: no recomputed pi_prox. The first minibatch (on-policy) takes
    pi_prox from its own forward, so stale sequences are weighted by own/engine; a later one's
    pi_old is the engine's, so every weight is 1 and the loss is the synchronous one."""
    from gspo_mcore.config import LossConfig
    from gspo_mcore.gspo.loss import behavior_weight, objective

    batch = _async_batch(seed=3)
    engine = batch["engine_logprobs"]
    stale = torch.zeros_like(batch["mask"])
    stale[:, :4] = 1.0
    free = {"old_logprobs": engine, "advantages": batch["advantages"], "mask": batch["mask"], "stale": stale}
    cfg = LossConfig(clip_low=0.05, clip_high=0.05)
    logp = engine + 0.01
    later, metrics = objective(logp, free, cfg)
    plain, _ = objective(logp, {k: v for k, v in free.items() if k != "stale"}, cfg)
    assert later.item() == plain.item() and metrics["behavior_weight_mean"].item() == 1.0
    first, metrics = objective(logp, free, cfg, on_policy=True)
    expected, _ = behavior_weight(logp, engine, stale, batch["mask"], cfg.behavior_weight_cap)
    assert metrics["behavior_weight_mean"].item() == pytest.approx(
        expected[batch["mask"].sum(-1) > 0].mean().item())


def test_a_step_without_current_version_tokens_keeps_the_latest_mismatch_band(monkeypatch):
    """loss.band_from_mismatch in the asynchronous modes: a first minibatch with no token of the
    current weights (generation ran ahead: every token one version old) measures no mismatch, and
    the later minibatches keep the band of the latest one measured. It fell back to the
    configured 4e-4 (10x narrower than sync's on a bf16 engine): half the steps of an async run
    on long_cpu clipped at the paper's band while sync clipped at ~0.008."""
    from gspo_mcore.megatron import learner as learner_module
    from gspo_mcore.config import Config

    monkeypatch.setattr(learner_module.parallel_state, "is_pipeline_last_stage", lambda: True)
    monkeypatch.setattr(learner_module, "_gather_dp", lambda parts: parts)  # one data-parallel rank
    learner = learner_module.Learner.__new__(learner_module.Learner)  # the band needs no model
    learner.config, learner.last_mismatch = Config(), None

    def first(mismatch, fresh):
        return [{"num_sequences": 4.0, "mismatch_num_sequences": fresh, "mismatch_abs_log_ratio_mean": mismatch}]

    assert learner._band_from_mismatch(first(0.0, 0.0)) == (3e-4, 4e-4)  # nothing measured yet: the config's
    assert learner._band_from_mismatch(first(0.005, 3.0)) == pytest.approx((0.01, 0.01))
    assert learner._band_from_mismatch(first(0.0, 0.0)) == pytest.approx((0.01, 0.01))  # all stale: kept
    assert learner._band_from_mismatch(first(0.0001, 1.0)) == pytest.approx((3e-4, 4e-4))  # measured again


def _linear_policy(seed=0, B=6, T=9, vocab=5):
    """A model (one linear layer) and the log-probs of sampled tokens under it: a loss's gradient
    reaches its weight only through `logprobs`."""
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Linear(4, vocab, dtype=torch.float64)
    features, tokens = torch.randn(B, T, 4, generator=g, dtype=torch.float64), torch.randint(vocab, (B, T), generator=g)

    def logprobs():
        return model(features).log_softmax(-1).gather(-1, tokens[..., None])[..., 0]

    return model, logprobs


def test_a_users_loss_by_name_gets_the_documented_inputs_and_its_gradient_reaches_the_model():
    import loss_fixtures

    from gspo_mcore.config import LossConfig
    from gspo_mcore.gspo.loss import LossInputs, objective

    _, old, adv, mask = make_batch()
    model, logprobs = _linear_policy()
    engine = old + 0.01
    batch = {"old_logprobs": old, "engine_logprobs": engine, "advantages": adv, "mask": mask}
    normalizer = Normalizer(num_sequences=12.0, num_tokens=80.0, horizon=9.0)
    grads = {}
    for name in ("gspo", "loss_fixtures:doubled_gspo"):
        cfg = LossConfig(function=name, clip_low=EPS_LOW, clip_high=EPS_HIGH)
        model.zero_grad()
        logp = logprobs()
        loss, metrics = objective(logp, batch, cfg, normalizer, band=(0.1, 0.3))
        loss.backward()
        grads[name] = (loss.detach(), model.weight.grad.clone(), metrics)
    (gspo_loss, gspo_grad, gspo_metrics), (loss, grad, metrics) = grads.values()
    assert torch.equal(loss, 2 * gspo_loss) and torch.equal(grad, 2 * gspo_grad) and grad.abs().sum() > 0
    assert metrics.keys() == gspo_metrics.keys()  # its own figures and those added around it
    got = loss_fixtures.CALLS[-1]
    assert isinstance(got, LossInputs) and got.logprobs.requires_grad
    assert got.old_logprobs is old and got.engine_logprobs is engine and got.advantages is adv and got.mask is mask
    assert (got.clip_low, got.clip_high, got.normalizer, got.entropy) == (0.1, 0.3, normalizer, None)


def test_a_users_loss_may_differ_from_the_built_ins():
    from gspo_mcore.config import LossConfig
    from gspo_mcore.gspo.loss import objective

    logp, old, adv, mask = make_batch()
    loss, metrics = objective(logp, {"old_logprobs": old, "advantages": adv, "mask": mask},
                              LossConfig(function="loss_fixtures:reinforce"))
    expected = -sum((adv[i] * logp[i] * mask[i]).sum() / mask[i].sum() for i in range(len(adv))) / len(adv)
    torch.testing.assert_close(loss, expected)
    assert "clip_fraction" not in metrics and "mismatch_abs_log_ratio_mean" in metrics  # the mismatch: always


@pytest.mark.parametrize("function, level", [("gspo", "sequence"), ("gspo_token", "sequence_token"), ("grpo", "token")])
def test_the_built_in_losses_are_functions_by_name_on_the_same_path(function, level):
    from gspo_mcore.config import LossConfig
    from gspo_mcore.gspo.loss import LOSSES, load_loss_function, objective

    assert load_loss_function(function) is LOSSES[function]
    logp, old, adv, mask = make_batch()
    loss, metrics = objective(logp, {"old_logprobs": old, "advantages": adv, "mask": mask},
                              LossConfig(function=function, clip_low=EPS_LOW, clip_high=EPS_HIGH))
    direct, direct_metrics = policy_loss(logp, old, adv, mask, level=level, clip_low=EPS_LOW, clip_high=EPS_HIGH)
    assert torch.equal(loss, direct) and metrics["clip_fraction"] == direct_metrics["clip_fraction"]


@pytest.mark.parametrize("name, message", [
    ("gpso", r"^loss.function 'gpso': not one of \['cispo', 'gmpo', 'grpo', 'gspo', 'gspo_token', 'luspo', 'sapo'\] "
             r"nor 'module:function'$"),
    ("no_such_module:f", r"^loss.function 'no_such_module:f': cannot import \(No module named 'no_such_module'\)$"),
    ("loss_fixtures:NOT_A_FUNCTION", r"^loss.function 'loss_fixtures:NOT_A_FUNCTION': not callable$"),
    ("loss_fixtures:one_argument", r"^loss.function 'loss_fixtures:one_argument': cannot be called as "
                                   r"fn\(inputs, config\) \(too many positional arguments\)$"),
])
def test_a_loss_that_cannot_be_used_is_one_line_at_start_up(name, message, tmp_path):
    from gspo_mcore.config import load_config
    from gspo_mcore.common.errors import InputError
    from gspo_mcore.run.start import check_inputs

    with pytest.raises(InputError, match=message):  # before the data, the reward, the model
        check_inputs(load_config(None, [f"loss.function={name}", f"data.path={tmp_path / 'missing.jsonl'}"]),
                     tmp_path, resume=False)


def test_the_torch_free_choices_name_every_built_in_loss():
    """The config reads gspo.choices (no torch); the tensor functions live in gspo.loss."""
    from gspo_mcore.gspo import choices, loss as loss_module

    assert tuple(loss_module.LOSSES) == choices.BUILT_IN_LOSSES
