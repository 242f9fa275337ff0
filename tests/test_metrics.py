"""The loss's metrics combined over microbatches and ranks equal the whole minibatch's, and
the step report takes each figure from where it is defined."""

import json
import time

import pytest
import torch

from gspo_mcore.gspo.loss import objective, policy_loss
from gspo_mcore.metrics.report import all_to_floats, combine, to_floats, update_report


def batch(seed=0, B=7, T=10):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([10, 1, 0, 6, 3, 8, 5])[:B]  # one empty response
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logp = old + 0.05 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    entropy = torch.rand(B, T, generator=g, dtype=torch.float64)
    return logp, old, adv, mask, entropy


@pytest.mark.parametrize("level", ["sequence", "sequence_token", "token"])
def test_combined_microbatch_metrics_equal_the_whole_batch(level):
    logp, old, adv, mask, entropy = batch()
    kwargs = dict(level=level, clip_low=0.02, clip_high=0.03)
    _, whole = policy_loss(logp, old, adv, mask, entropy=entropy, **kwargs)
    splits = (slice(0, 2), slice(2, 3), slice(3, 7))  # the middle one holds only the empty response
    parts = [to_floats(policy_loss(logp[s], old[s], adv[s], mask[s], entropy=entropy[s], **kwargs)[1])
             for s in splits]
    combined = combine(parts)
    assert set(combined) == set(whole)
    for key, value in whole.items():
        assert combined[key] == pytest.approx(value.item(), abs=1e-12), key
    # The band really splits the batch, and the token-level share adds up from its two sides.
    assert 0 < whole["clip_fraction"] < 1
    assert whole["clip_fraction"] == pytest.approx((whole["clip_fraction_low"] + whole["clip_fraction_high"]).item())
    # Length normalisation: the per-sequence |log s_i| is below the per-token mismatch.
    assert whole["abs_log_ratio_mean"] < whole["abs_log_ratio_token_mean"]


def test_token_level_clip_fraction_counts_tokens_not_sequence_ratios():
    """GRPO's clip fraction is over its own token ratios (the old trainer recomputed it from the
    sequence ratio under every level, so GSPO and GRPO plotted two different quantities)."""
    logp, old, adv, mask, _ = batch(seed=3)
    _, token = policy_loss(logp, old, adv, mask, level="token", clip_low=0.02, clip_high=0.03)
    ratio = (logp - old).exp()
    a = adv[:, None].expand_as(ratio)
    clipped = (((a > 0) & (ratio > 1.03)) | ((a < 0) & (ratio < 0.98))) & mask.bool()
    assert token["clip_fraction"].item() == pytest.approx(clipped.sum().item() / mask.sum().item())


def test_every_loss_figure_is_a_schema_row_and_every_loss_row_is_computed():
    """A metric is either reported (a row of metric_schema with its combination rule) or not
    computed: the loss with every term on makes exactly the schema's loss rows."""
    from gspo_mcore.config import LossConfig
    from gspo_mcore.metrics.schema import LOSS_METRICS

    logp, old, adv, mask, entropy = batch()
    cfg = LossConfig(kl_loss_coef=0.1, entropy_coef=0.1, token_mask_band=[0.5, 2.0], sequence_mask_threshold=0.1)
    _, metrics = objective(logp, {"old_logprobs": old, "advantages": adv, "mask": mask, "ref_logprobs": old,
                                  "engine_logprobs": old - 0.1, "stale": torch.ones_like(mask)}, cfg, entropy=entropy)
    # The two mismatch corrections exclude each other: each one's figures from a loss of its own.
    for correction in ("token_tis", "sequence_mis"):
        metrics.update(objective(logp, {"old_logprobs": old, "advantages": adv, "mask": mask,
                                        "engine_logprobs": old - 0.1}, LossConfig(mismatch_correction=correction))[1])
    assert set(metrics) | {"loss"} == {m.name for m in LOSS_METRICS}


def test_update_report_takes_mismatch_from_the_first_step_and_averages_the_loss():
    step = lambda loss, ratio: [{"loss": loss / 2, "num_tokens": 4.0, "num_sequences": 2.0, "clip_fraction": 0.5,
                                 "mismatch_num_sequences": 2.0, "mismatch_num_tokens": 4.0,
                                 "mismatch_abs_log_ratio_mean": ratio, "mismatch_abs_log_ratio_max": 2 * ratio,
                                 "mismatch_token_abs_log_ratio_mean": 3 * ratio,
                                 "mismatch_out_of_band_fraction": 0.75}] * 2
    report = update_report([step(1.0, 0.1), step(3.0, 0.7)])
    assert report["loss"] == pytest.approx(2.0)
    assert report["kl"] is None and report["entropy"] is None  # not computed: null, never made up
    assert report["mismatch_abs_log_ratio_mean"] == pytest.approx(0.1)
    assert report["mismatch_abs_log_ratio_max"] == pytest.approx(0.2)
    assert report["mismatch_token_abs_log_ratio_mean"] == pytest.approx(0.3)
    assert report["mismatch_out_of_band_fraction"] == pytest.approx(0.75)
    assert report["clip_fraction"] == pytest.approx(0.5)


def test_engine_mismatch_per_sequence_and_token_combine_exactly():
    from gspo_mcore.gspo.loss import engine_mismatch

    logp, old, _, mask, _ = batch(seed=4)
    whole = engine_mismatch(logp, old, mask, 3e-4, 4e-4)
    seq = ((logp - old) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    kept = mask.sum(-1) > 0
    assert whole["mismatch_abs_log_ratio_mean"].item() == pytest.approx(seq[kept].abs().mean().item())
    assert whole["mismatch_token_abs_log_ratio_mean"].item() == pytest.approx(((logp - old).abs() * mask).sum().item() / mask.sum().item())
    band = ((seq.exp() > 1 + 4e-4) | (seq.exp() < 1 - 3e-4)) & kept
    assert whole["mismatch_out_of_band_fraction"].item() == pytest.approx(band.sum().item() / kept.sum().item())
    parts = [to_floats(engine_mismatch(logp[s], old[s], mask[s], 3e-4, 4e-4))
             for s in (slice(0, 2), slice(2, 3), slice(3, 7))]
    combined = combine(parts)
    for key, value in whole.items():
        assert combined[key] == pytest.approx(value.item(), abs=1e-12), key


def test_run_log_refuses_a_figure_outside_the_schema(tmp_path):
    from gspo_mcore.metrics.report import RunLog

    log = RunLog(tmp_path)
    try:
        log.write({"step": 1, "reward_mean": 0.5})
        with pytest.raises(KeyError, match="reward_avg"):
            log.write({"step": 2, "reward_avg": 0.5})
    finally:
        log.close()
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        {"step": 1, "reward_mean": 0.5}]


def test_weights_and_biases_offline_gets_the_same_rows_and_a_resume_continues_its_run(tmp_path, monkeypatch):
    """train.wandb_project: W&B as a third sink, offline without a network; a resumed run keeps its id."""
    from gspo_mcore.metrics.report import RunLog

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = RunLog(tmp_path, wandb_project="gspo-test", run_config={"train": {"seed": 3}})
    log.write({"step": 1, "reward_mean": 0.25, "router_max_over_mean_load": [1.5, 2.0]})
    log.close()
    run_id = (tmp_path / "wandb_run_id").read_text()
    runs = list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    # W&B names a run's directory by the second it started: the resume starts in the next one
    # (within the same second both runs share one directory and the count below reads 1).
    time.sleep(1.05 - time.time() % 1)
    log = RunLog(tmp_path, start_step=1, wandb_project="gspo-test")
    log.write({"step": 2, "reward_mean": 0.5})
    log.close()
    assert (tmp_path / "wandb_run_id").read_text() == run_id
    assert len(list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))) == 2  # the same id, resumed


def test_the_progress_line_keeps_its_columns_and_names_each_idle_share():
    """A step that trained nothing had no mismatch, and the columns after it moved left; the async
    line read "idle: trainer 0.12 engine idle 0.50"; a tool loop's turns and tool errors were missing."""
    import io

    from gspo_mcore.metrics.report import Progress

    base = {"reward_mean": 0.5, "reward_std": 0.5, "response_length_mean": 3.0, "clip_fraction": 0.1,
            "engine_mismatch_mean": 2e-7, "engine_idle_fraction": 0.5, "trainer_idle_fraction": 0.12,
            "time_rollout_s": 1.0, "time_train_s": 0.5, "time_sync_s": 0.1, "turns_mean": 2.0, "tool_errors": 1}
    out = io.StringIO()
    progress = Progress(3, stream=out)
    progress.update({**base, "step": 1})
    progress.update({**base, "step": 2, "clip_fraction": None, "engine_mismatch_mean": None})
    progress.update({**base, "step": 3, "staleness_mean": None})
    first, second, third = (line.split("] ", 1)[1].rsplit(" | ETA", 1)[0] for line in out.getvalue().splitlines())
    assert "turns 2.0 tool errors 1" in first and "| trainer idle 0.12 engine idle 0.50" in first
    assert second == first.replace("clip 0.100", "clip -").replace("mismatch 2.0e-07", "mismatch -")
    assert third == first and "stale" not in first  # never measured: not shown


def test_a_score_that_no_program_made_and_truncation_show_on_the_progress_line_when_not_0():
    """A code run whose responses held no program read "reward 0.000 ... " and nothing else (the
    count was in metrics.jsonl only): the shares of responses with no program and of truncated
    ones are printed on a step where they are not 0, and not otherwise."""
    import io

    from gspo_mcore.metrics.report import Progress
    from gspo_mcore.rewards.code import step_figures

    figures = step_figures({"code_tests_run": 0, "code_sandbox_s": 0.0, "code_no_program": 24, "code_responses": 24,
                            "code_hacks": 0, "code_hack_checked": 0})
    assert figures["code_no_program_fraction"] == 1.0
    assert step_figures({})["code_no_program_fraction"] is None  # not a code reward
    out = io.StringIO()
    progress = Progress(2, stream=out)
    progress.update({"step": 1, "reward_mean": 0.0, "truncated_fraction": 0.25, **figures})
    progress.update({"step": 2, "reward_mean": 0.5, "truncated_fraction": 0.0, "code_no_program_fraction": 0.0})
    first, second = out.getvalue().splitlines()
    assert "no program 100%" in first and "truncated 25%" in first
    assert "no program" not in second and "truncated" not in second


def test_every_run_ends_with_its_summary_and_writes_summary_json(tmp_path):
    """First and last 10 steps' mean reward (half the run when it is shorter) and each held-out
    score before and after: printed lines and OUTPUT_DIR/summary.json (a plain gspo-train printed
    neither; comparing GSPO with GRPO meant computing them by hand)."""
    import json

    from gspo_mcore.run.summary import write_summary

    rewards = [0.1 * (i % 5) for i in range(30)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "reward_mean": r}) + "\n"
                                                    for i, r in enumerate(rewards)))
    (tmp_path / "eval.jsonl").write_text(json.dumps({"step": 0, "version": "step-0", "eval/toy/mean@4": 0.25}) + "\n"
                                         + json.dumps({"step": 30, "version": "step-30", "eval/toy/mean@4": 0.9}) + "\n")
    said = write_summary(tmp_path)
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert said == [f"mean reward: first 10 steps {first:.3f} -> last 10 steps {last:.3f} ({last - first:+.3f})",
                    "held-out toy/mean@4: step 0 0.250 -> step 30 0.900"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 30 and summary["reward_gain"] == pytest.approx(last - first)
    assert summary["held_out"]["eval/toy/mean@4"] == {"before": 0.25, "after": 0.9, "before_step": 0, "after_step": 30}
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "reward_mean": float(i)}) + "\n"
                                                    for i in range(4)))
    (tmp_path / "eval.jsonl").unlink()
    assert write_summary(tmp_path) == ["mean reward: first 2 steps 0.500 -> last 2 steps 2.500 (+2.000)"]


def test_an_updates_microbatch_metrics_come_to_the_host_in_one_copy(monkeypatch):
    """On a GPU each copy to the host waits for the device: the learner reads every microbatch's
    metrics at once, each microbatch keeping its own keys and values (one may have fewer)."""
    parts = [{"loss": torch.tensor(0.5), "clip_fraction": torch.tensor(0.25)}, {"loss": torch.tensor(-1.0)},
             {"loss": torch.tensor(2.0, dtype=torch.float32), "clip_fraction": torch.tensor(0.0)}]
    copies = []
    real_cpu = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: copies.append(self.shape) or real_cpu(self, *a, **k))
    assert all_to_floats(parts) == [{"loss": 0.5, "clip_fraction": 0.25}, {"loss": -1.0},
                                    {"loss": 2.0, "clip_fraction": 0.0}]
    assert copies == [torch.Size([5])]
    assert all_to_floats([]) == [] and to_floats({"loss": torch.tensor(3.0)}) == {"loss": 3.0}
