"""bench/doc_figures.py: every figure block the docs hold is one it makes again, and each says
what made it (the command, the seeds, the date, the revision). docs/07 quoted the lineage's
gains with no seed or command (cispo +0.58 / +0.60; a new user's run gave +0.691), so a reader
could not tell stale from noise."""

import re
import sys

import pytest

from helpers import REPO

sys.path.insert(0, str(REPO / "bench"))
import doc_figures  # noqa: E402

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_every_marked_block_is_one_the_script_makes_and_says_what_made_it():
    found = {name: (doc.relative_to(REPO).as_posix(), text) for doc in DOCS
             for name, text in doc_figures.marked(doc.read_text()).items()}
    assert sorted(found) == sorted(doc_figures.BLOCKS)
    for name, (doc, text) in found.items():
        assert doc == doc_figures.BLOCKS[name].doc
        assert f"`python bench/doc_figures.py {name}` on 20" in text and re.search(r"seeds? \d+|train.seed` \d+", text)


def test_a_block_is_rendered_with_its_command_and_seeds_and_replaced_alone():
    made = doc_figures.Made("python bench/doc_figures.py lineage_gains", "2026-12-02", "abc1234")
    text = doc_figures.render_lineage({"gains": {"gspo": [0.51, 0.6], "cispo": [0.691, -0.02]}, "seeds": [1234, 1235],
                                       "steps": 30}, made)
    assert "30 steps" in text and "seeds 1234 and 1235" in text and "gspo +0.51 / +0.60, cispo +0.69 / -0.02" in text
    assert "Made by `python bench/doc_figures.py lineage_gains` on 2026-12-02 at abc1234" in text
    doc = "before\n<!-- figures: lineage_gains -->\nold\nlines\n<!-- /figures: lineage_gains -->\nafter\n"
    assert doc_figures.replaced(doc, "lineage_gains", text) == doc.replace("old\nlines", text)
    assert doc_figures.marked(doc_figures.replaced(doc, "lineage_gains", text)) == {"lineage_gains": text}
    with pytest.raises(SystemExit, match=r"^error: no block 'demo' \(<!-- figures: demo -->"):
        doc_figures.replaced(doc, "demo", text)


def test_the_demo_block_quotes_the_run_as_make_demo_prints_it():
    figures = {"lines": ["step    1/40 [---] reward 0.258", "...", "step   40/40 [###] reward 0.953",
                         "the exported model again: python -m gspo_mcore.evaluation.cli --config configs/tiny_cpu.yaml "
                         "--model /tmp/x/demo/tiny_cpu"], "seed": 1234, "out": "/tmp/x/demo"}
    text = doc_figures.render_demo(figures, doc_figures.Made("python bench/doc_figures.py demo", "2026-12-02", "abc"))
    assert text.startswith("```\nstep    1/40") and "--model outputs/demo/tiny_cpu\n```" in text
    assert text.endswith("(Made by `python bench/doc_figures.py demo` on 2026-12-02 at abc: `make demo`, "
                         "`train.seed` 1234.)")


def test_an_unknown_block_is_one_line(capsys):
    with pytest.raises(SystemExit, match=r"^error: 'nosuch' is not a block: one of lineage_gains, demo, losses_grid, agent, agent_ablations, "
                       r"engines, claim_grid, claim_more, claim_mismatch, claim_async, async_seeded, async_modes, async_balanced, "
                       r"mismatch_sources, step_time$"):
        doc_figures.main(["nosuch"])
    assert doc_figures.main(["--list"]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith("lineage_gains: docs/07-loss.md: ")


def test_the_engines_block_is_a_row_per_engine():
    one = {"reward_first": 0.293, "reward_last": 0.951, "reward_gain": 0.658, "generated_tokens_per_s": 737.2,
           "step_s": 0.521, "mismatch_max": 3.2e-7, "server_start_s": 19}
    text = doc_figures.render_engines({"sglang": one, "vllm": {**one, "mismatch_max": None}, "seed": 1234, "steps": 40},
                                      doc_figures.Made("python bench/doc_figures.py engines", "2026-12-02", "abc"))
    assert "`python bench/engines.py --steps 40`, `train.seed` 1234" in text
    assert text.splitlines()[-2:] == [
        "| SGLang (`configs/tiny_cpu.yaml`) | 0.293 -> 0.951 (+0.658) | 737 | 0.52 | 3.2e-07 | 19 s |",
        "| vLLM (`configs/tiny_cpu_vllm.yaml`) | 0.293 -> 0.951 (+0.658) | 737 | 0.52 | - | 19 s |"]


def test_the_losses_grid_block_has_both_tables_and_the_seeds_start():
    def arm(per_seed, clip):
        return {"final_reward_mean": sum(per_seed) / 3, "final_reward_sd": 0.05, "final_reward_per_seed": per_seed,
                "clip_fraction": clip, "mismatch_seq": 0.00531, "out_of_band": 0.93, "response_length": 39.4,
                "train_s_per_step": 0.95, "mismatch_truncated_fraction": None, "mismatch_masked_fraction": None}

    arms = {"gspo": arm([0.411, 0.384, 0.471], 0.279), "sapo": arm([0.419, 0.414, 0.309], None)}
    starts = {a: [{"first_step": f, "first_steps": g} for f, g in ((0.211, 0.22), (0.202, 0.24), (0.216, 0.23))]
              for a in arms}
    text = doc_figures.render_losses_grid({"arms": arms, "starts": starts, "seeds": [1234, 1235, 1236]},
                                          doc_figures.Made("python bench/doc_figures.py losses_grid", "2026-12-02", "a"))
    assert "seeds 1234, 1235, 1236; each seed's first step drew the same responses in every arm, reward 0.211, 0.202, " \
           "0.216)" in text and "first 7 steps: 0.22-0.24)" in text
    assert "| gspo | 0.422 +- 0.050 | 0.279 | - | 0.00531 | 93% | 39.4 | 0.95 |" in text
    assert "| sapo | 0.381 +- 0.050 | - | - |" in text  # SAPO clips nothing
    assert text.endswith("| sapo | 0.419 | 0.414 | 0.309 | +0.008, +0.030, -0.162 |")


def test_a_block_made_again_from_its_runs_keeps_the_revision_they_were_made_at(tmp_path, monkeypatch):
    """Rendering again from runs already made (a renderer's fix) said the current revision, not the
    one the runs came from."""
    (tmp_path / "doc.md").write_text("a\n<!-- figures: toy -->\nold\n<!-- /figures: toy -->\nb\n")
    runs = []
    block = doc_figures.Block("doc.md", "a toy", lambda out: runs.append(out) or {"x": len(runs)},
                              lambda figures, made: f"x {figures['x']} at {made.revision} (`{made.command}`)")
    monkeypatch.setattr(doc_figures, "REPO", tmp_path)
    monkeypatch.setattr(doc_figures, "BLOCKS", {"toy": block})
    revisions = iter(["first", "second"])
    monkeypatch.setattr(doc_figures, "made_now", lambda name: doc_figures.Made(f"python bench/doc_figures.py {name}",
                                                                               "2026-12-02", next(revisions)))
    assert doc_figures.main(["toy", "--out", str(tmp_path / "out")]) == 0
    assert doc_figures.main(["toy", "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "doc.md").read_text() == ("a\n<!-- figures: toy -->\nx 2 at first (`python bench/doc_figures.py "
                                                 "toy`)\n<!-- /figures: toy -->\nb\n")
    assert runs == [tmp_path / "out" / "toy"] * 2 and not list(tmp_path.glob("*.tmp"))


def claim_arm(per_seed, routing=0.0177, seq=0.0053, tok=0.0188, steps=(20, None, 17)):
    return {"final_reward_mean": sum(per_seed) / len(per_seed), "final_reward_sd": 0.045, "final_reward_per_seed": per_seed,
            "steps_to_threshold": list(steps), "mismatch_seq": seq, "mismatch_token": tok, "out_of_band": 0.93,
            "routing_mismatch": routing, "clip_fraction": 0.279, "train_s_per_step": 0.39, "clip_band_high": 0.0106}


def claim_figures(first_rewards=None):
    grid = {arm: claim_arm([0.4, 0.4, 0.4]) for arm in doc_figures.CLAIM_ARMS}
    grid["gspo-engine"] = claim_arm([0.411, 0.384, 0.471])
    grid["gspo-async"] = claim_arm([0.446, 0.325, 0.335], routing=0.0179)
    grid["gspo-engine-replay"] = claim_arm([0.35, 0.3, 0.4], routing=0.0, seq=0.0014, tok=0.0086)
    grid["grpo-engine"] = claim_arm([0.4, 0.4, 0.4], routing=0.0197)
    more = {arm: claim_arm(values) for arm, values in (("gspo-engine", [0.41, 0.38, 0.47, 0.35, 0.45, 0.38]),
                                                       ("gspo-recompute", [0.54, 0.37, 0.52, 0.33, 0.40, 0.41]),
                                                       ("gspo-engine-paper", [0.35, 0.39, 0.35, 0.31, 0.36, 0.35]))}
    return {"grid": grid, "more": more, "seeds": [1234, 1235, 1236], "more_seeds": list(range(1234, 1240)),
            "threshold": 0.35, "first_rewards": first_rewards or {arm: [0.211, 0.2, 0.22] for arm in grid},
            "first_mismatch": [0.011, 0.009, 0.01], "response_length": 38.2}


MADE = doc_figures.Made("python bench/doc_figures.py claim_grid", "2026-12-02", "abc")


def test_the_claim_grid_block_has_every_arm_and_each_arms_difference_per_seed():
    text = doc_figures.render_claim_grid(claim_figures(), MADE)
    assert text.startswith("30 runs, made by `python bench/doc_figures.py claim_grid` on 2026-12-02 at abc "
                           "(`python bench/claim.py --out DIR --seeds 3 --arms gspo-engine,gspo-recompute,")
    assert "each seed's first step draws the same responses in every arm (reward 0.211, 0.200, 0.220)" in text
    assert ("| **GSPO, engine log-probs (default)** | **0.422 +- 0.045** | 20, -, 17 | 0.0053 | 93% | 1.77% | 0.28 | "
            "0.39 |") in text
    assert "| GRPO, engine log-probs | 0.400 +- 0.045 | 20, -, 17 | 0.0053 | - | 1.97% |" in text  # GRPO has no band
    assert "| asynchronous | +0.035 | -0.059 | -0.136 | -0.053 |" in text  # async minus the default, per seed
    split = doc_figures.render_claim_grid(claim_figures({"gspo-engine": [0.211, 0.2, 0.22],
                                                         "gspo-async": [0.25, 0.2, 0.22]}), MADE)
    assert "the arms' first steps drew rewards 0.211-0.250 on seed 1234, 0.200-0.200 on seed 1235" in split


def test_the_claim_grids_six_seeds_say_each_arm_minus_the_default_and_its_standard_error():
    text = doc_figures.render_claim_more(claim_figures(), doc_figures.Made("python bench/doc_figures.py claim_more",
                                                                           "2026-12-02", "abc"))
    assert "on seeds 1234-1239 for the three arms that decide it, made by `python bench/doc_figures.py claim_more` " \
           "on 2026-12-02 at abc (`python bench/claim.py --out DIR --seeds 6 --arms gspo-engine,gspo-recompute," \
           "gspo-engine-paper` into the grid's DIR reuses its first 3 seeds' runs)" in text
    # 6 seeds: recompute minus the default, mean +- its standard error, and how many seeds ahead.
    assert "| GSPO, recomputed, same band rule | 0.428 +- 0.045 | 0.540, 0.370, 0.520, 0.330, 0.400, 0.410 | " \
           "+0.022 +- 0.026 (3 of 6 ahead) | 0.39 |" in text
    assert "| GSPO, engine log-probs, paper band | 0.352 +- 0.045 | 0.350, 0.390, 0.350, 0.310, 0.360, 0.350 | " \
           "-0.055 +- 0.019 (5 of 6 behind) | 0.39 |" in text


def test_the_mismatch_paragraph_is_said_from_the_grid():
    text = doc_figures.render_claim_mismatch(claim_figures(), MADE)
    assert "~38-token responses" in text and "mean |d| of 0.0188" in text and "|log s_i| of GSPO's sequence ratio " \
        "is 0.0053 averaged over a run (0.0100 at the initial weights, falling as the policy trains): 13x" in text
    assert "1.77%-1.97% of (token, MoE layer) pairs" in text  # replay's 0 is not a routing mismatch
    assert "from 0.0053 to 0.0014 (74%) and the per-token one from 0.0188 to 0.0086. So the router is most" in text
    assert text.endswith("(0.0086 / sqrt(38) = 0.0014).")


def test_the_claim_grids_async_arm_is_two_rows_and_the_paired_difference():
    text = doc_figures.render_claim_async(claim_figures(), MADE)
    assert "| async, max_staleness 1 | 0.369 +- 0.045 | 0.446, 0.325, 0.335 | 20, -, 17 | 0.279 | 0.0106 |" in text
    assert "Async minus sync per seed: +0.035, -0.059, -0.136 (mean -0.053 +- 0.049;" in text


def test_the_async_block_pairs_each_mode_with_sync_seed_by_seed():
    def mode(per_step, samples):
        return {"samples_per_s": samples, "per_step": per_step, "in_time": per_step - 0.02, "held_out": per_step + 0.01,
                "clip_fraction": 0.25, "band": 0.01}

    seeds = [{"seed": 1, "sync": mode(0.441, 40.7), "async": mode(0.435, 55.0), "async-first-minibatch": mode(0.4, 56)},
             {"seed": 2, "sync": mode(0.380, 41.5), "async": mode(0.349, 51.3), "async-first-minibatch": mode(0.4, 52)}]
    line = {"async_speedup": 1.2345, "async_first_minibatch_speedup": 1.3, "overlap_bound": 1.27,
            "max_staleness_seen": 1, "tokens_regenerated": 0.0}
    text = doc_figures.render_async({"line": line, "seeds": seeds, "modes": ["sync", "async", "async-first-minibatch"]},
                                    doc_figures.Made("python bench/doc_figures.py async_seeded", "2026-12-02", "abc"))
    assert "`python bench/async.py --out DIR --steps 28 --modes sync,async,async-first-minibatch --seeds 1,2,3,4,5,6 " \
           "rollout.max_new_tokens=40`, seeds 1, 2 (`train.seed`)" in text
    assert "| seed | sync samples/s | async samples/s | first-minibatch samples/s | sync per step | async per step |" in text
    assert "| 1 | 40.7 | 55.0 | 56.0 | 0.441 | 0.435 | 0.400 | 0.421 | 0.415 | 0.380 | 0.451 | 0.445 | 0.410 |" in text
    assert "| mean +- sd |  | 1.23x | 1.30x | 0.410 +- 0.043 | 0.392 +- 0.061 | 0.400 +- 0.000 |" in text
    assert "Async minus sync, paired by seed (mean +- standard error): per step -0.019 +- 0.013 (ahead on 0 of 2; " \
           "-0.006, -0.031)" in text
    assert "First-minibatch minus sync, paired by seed (mean +- standard error): per step -0.010 +- 0.030 (ahead on " \
           "1 of 2; -0.041, +0.020)" in text
    assert '`{"async_speedup": 1.23, "async_first_minibatch_speedup": 1.30, "overlap_bound": 1.27, ' \
           '"max_staleness_seen": 1, "tokens_regenerated": 0}`' in text


def test_a_block_rendered_from_another_blocks_runs_uses_its_dir_and_stamp(tmp_path, monkeypatch):
    (tmp_path / "doc.md").write_text("<!-- figures: a -->\nold\n<!-- /figures: a -->\n<!-- figures: b -->\nold\n<!-- /figures: b -->\n")
    seen = []
    make = (lambda out: seen.append(out) or {})
    monkeypatch.setattr(doc_figures, "REPO", tmp_path)
    monkeypatch.setattr(doc_figures, "BLOCKS", {
        "a": doc_figures.Block("doc.md", "a", make, lambda f, made: f"a at {made.revision} ({made.command})"),
        "b": doc_figures.Block("doc.md", "b", make, lambda f, made: f"b at {made.revision} ({made.command})",
                                     runs="a")})
    revisions = iter(["first", "second"])
    monkeypatch.setattr(doc_figures, "made_now", lambda name: doc_figures.Made("", "2026-12-02", next(revisions)))
    assert doc_figures.main(["a", "b", "--out", str(tmp_path / "out")]) == 0
    assert seen == [tmp_path / "out" / "a"] * 2
    assert doc_figures.marked((tmp_path / "doc.md").read_text()) == {"a": "a at first (python bench/doc_figures.py a)",
                                                                 "b": "b at first (python bench/doc_figures.py b)"}


def test_the_modes_block_is_a_row_per_mode_and_each_speedup_against_the_bound():
    def mode(samples, step, rollout, train, engine_idle, regenerated=0):
        return {"samples_per_s": samples, "step_s": step, "rollout_s": rollout, "train_s": train, "sync_s": 0.06,
                "idle": 0.5, "engine_idle": engine_idle, "staleness_max": 1, "tokens_regenerated": regenerated}

    modes = {"sync": mode(7.4, 8.0, 6.0, 2.0, 0.17), "async": mode(9.2, 6.9, 4.3, 2.5, 0.12),
             "async-restart": mode(6.5, 9.8, 5.6, 3.2, 0.18, regenerated=10220)}
    modes["sync"]["staleness_max"] = 0
    line = {"async_speedup": 1.24, "async_restart_speedup": 0.88, "overlap_bound": 1.2, "max_staleness_seen": 1}
    args = ["--steps", "10", "--modes", "sync,async,async-restart", "train.ppo_epochs=4"]
    text = doc_figures.render_modes({"line": line, "args": args, "seed": 1234, "modes": modes},
                                    doc_figures.Made("python bench/doc_figures.py async_balanced", "2026-12-02", "abc"))
    assert text.startswith("Made by `python bench/doc_figures.py async_balanced` on 2026-12-02 at abc: `python "
                           "bench/async.py --out DIR --steps 10 --modes sync,async,async-restart train.ppo_epochs=4`, "
                           "`train.seed` 1234 (configs/long_cpu.yaml's) in every mode, 10 steps (steps 2-10")
    assert "| sync | 7.4 | 8.00 | 6.00 | 2.00 | 0.06 | 0.50 | 0.17 | 0 | 0 |" in text
    assert "| async-restart | 6.5 | 9.80 | 5.60 | 3.20 | 0.06 | 0.50 | 0.18 | 1 | 10220 |" in text
    assert "Generation is 75% of a synchronous step, so overlap alone could give at most 1.20x; async 1.24x (103% " \
           "of the bound; its train phase 1.25x sync's, the engine idle 12% of the time against 17%)" in text


def test_the_mismatch_sources_block_is_a_row_per_comparison():
    def row(seq, tail=0.1, flips=None):
        return {"seq_mean_abs_log_ratio": seq, "token_share_abs_over_0.1": tail, "routing_flips_vs_fp32": flips,
                "bias_t": -1.94, "seq_mean_abs_log_ratio_tail_zeroed": 0.0041, "seq_out_of_band": 0.97,
                "seq_out_of_band_after_first_half_offset": 0.94, "seq_band_for_90pct": 0.0251}

    line = {"bf16 engine vs fp32 trainer": row(0.0135, flips=0.0), "bf16 engine vs bf16 weights trainer":
            row(0.0066, 0.06, 0.019), "bf16 engine vs bf16 trainer": row(0.013, 0.07, 0.033),
            "bf16 engine decode vs its prefill": row(0.005, 0.03), "fp32 engine vs fp32 trainer": row(1.1e-7, 0.0, 0.0),
            "bf16 trainer vs fp32 trainer": {"tokens_flipped": 0.088, "mean_abs_d_flipped_tokens": 0.2612,
                                             "mean_abs_d_other_tokens": 0.0231}}
    text = doc_figures.render_mismatch_sources({"line": line, "seed": 1234}, doc_figures.Made(
        "python bench/doc_figures.py mismatch_sources", "2026-12-02", "abc"))
    assert "`python bench/mismatch_sources.py` (32 responses of configs/long_cpu.yaml at the initial weights, every " \
           "request's sampling seeded from `train.seed` 1234;" in text
    assert "| float32 trainer (what training sees) | 0.0135 | 10% | - |" in text  # its flips are against itself
    assert "| trainer with bf16-rounded weights, float32 compute | 0.0066 | 6% | 1.9% |" in text
    assert "| its own prefill of the same tokens (decoding, batching) | 0.0050 | 3% | - |" in text
    assert "| (float32 engine vs float32 trainer) | 1.1e-07 | 0% | - |" in text
    assert "t-statistic is -1.9; zeroing the tail (|d| > 0.1) leaves |log s_i| 0.0041;" in text
    assert "leaves 94% of those sequences out of the paper's band (97% before)" in text
    assert text.endswith("the 9% of tokens that any layer routes differently carry mean |d| 0.261 against 0.023 for "
                         "the rest.")


def test_the_step_time_block_says_both_arms_and_the_ratios():
    line = {"step_time_ratio": 0.9487, "train_time_ratio": 0.8012, "engine_step_s": 2.59, "recompute_step_s": 2.73,
            "rollout_s": 1.97, "engine_train_s": 0.55, "recompute_train_s": 0.69, "steps": 8}
    text = doc_figures.render_step_time({"line": line, "seed": 1234}, doc_figures.Made(
        "python bench/doc_figures.py step_time", "2026-12-02", "abc"))
    assert "`python bench/step.py --steps 8` (configs/long_cpu.yaml, `train.seed` 1234, both arms on the same 8 " \
           "batches after a warm-up step" in text
    assert "2.59 s a step with the engine's log-probs against 2.73 s recomputing (`step_time_ratio` 0.95); the train " \
           "phase 0.55 s against 0.69 s (`train_time_ratio` 0.80); generation is 76% of the engine arm's step." in text


def test_the_agent_ablations_block_says_each_run_and_its_lowest_step():
    def run(writer, first, last, lowest, step):
        return {"writer": writer, "seed": 1234, "first": first, "last": last, "gain": last - first, "lowest": lowest,
                "lowest_step": step}

    figures = {"seed": 1234, "key_hint": 0.2, "weak_hint": 0.1, "weak": [run(0, 0.3, 0.77, 0.25, 2)],
               "none": [run(0, 0.05, 0.13, 0.0, 4)], "no_warmup": [run(0, 0.41, 0.88, 0.3, 3), run(1, 0.2, 0.0, 0.0, 6)]}
    text = doc_figures.render_agent_ablations(figures, doc_figures.Made(
        "python bench/doc_figures.py agent_ablations", "2026-12-02", "abc"))
    assert "30 steps at `train.seed` 1234" in text and "a prior of 10% instead of 20%" in text
    assert "writer seed 0 0.30 -> 0.77 (+0.47; lowest step 2 at 0.25); no prior: writer seed 0 0.05 -> 0.13" in text
    assert text.endswith("the shipped prior: writer seed 0 0.41 -> 0.88 (+0.47; lowest step 3 at 0.30), writer seed "
                         "1 0.20 -> 0.00 (-0.20; lowest step 6 at 0.00).")
