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
    with pytest.raises(SystemExit, match=r"^error: 'nosuch' is not a block: one of lineage_gains, demo, losses_grid, agent, engines$"):
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
