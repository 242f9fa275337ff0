"""The plots a person reads: every axis of every figure has a label and tick labels, also for the
demo's float32 mismatch (values 1.5e-7..4.5e-7, under a decade on a log axis) and a bf16 one;
the step-time panels share one scale; a comparison does not overwrite a run's own figures."""

import random
from pathlib import Path

import pytest

from gspo_mcore.metrics.schema import FIGURES
from gspo_mcore.run.plot import default_out, figures


@pytest.fixture(autouse=True)
def _close_figures():
    """`figures` hands its figures to the caller, who closes them (plot_runs does, once saved)."""
    import matplotlib.pyplot as plt

    yield
    plt.close("all")


def _rows(mismatch_scale: float, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for step in range(1, 9):
        rows.append({"step": step, "reward_mean": 0.1 * step, "clip_fraction": rng.uniform(0, 0.3),
                     "response_length_mean": rng.uniform(5, 40),
                     "mismatch_abs_log_ratio_mean": mismatch_scale * rng.uniform(1.5, 4.5),
                     "clip_band_high": 4e-4, "time_rollout_s": rng.uniform(1, 3), "time_train_s": rng.uniform(0.2, 1),
                     "time_sync_s": 0.05 * seed, "time_step_s": 3.0,
                     **({"eval/toy/mean@4": 0.1 * step / 4, "eval/toy/pass@4": 0.2 * step / 4} if step % 4 == 0 else {})})
    return rows


def test_every_axis_has_a_label_and_tick_labels():
    runs = [_rows(1e-7, 1), _rows(1e-3, 2)]  # float32 and bf16 engines
    made = figures(runs, ["fp32", "bf16"])
    assert set(made) == {*FIGURES, "reward_wallclock", "eval"} - {"staleness", "idle"}  # those: async runs only
    for name, fig in made.items():
        fig.canvas.draw()
        for ax in fig.axes[:1] if name == "step_time" else fig.axes:  # the others share its y axis
            assert ax.get_xlabel() and ax.get_ylabel(), name
            shown = [t.get_text() for t in ax.get_yticklabels(which="both") if t.get_text()]
            assert len(shown) >= 2, (name, shown)
        if name == "step_time":
            first, second = fig.axes
            assert first.get_ylim() == second.get_ylim()


def test_mismatch_tick_labels_for_a_float32_run_alone():
    fig = figures([_rows(1e-7, 3)], ["demo"])["mismatch"]
    fig.canvas.draw()
    (ax,) = fig.axes
    low, high = ax.get_ylim()
    ticks = [t for t in ax.get_yticklabels(which="both") if t.get_text() and low <= t.get_position()[1] <= high]
    assert len(ticks) >= 2, [t.get_text() for t in ax.get_yticklabels(which="both")]


def test_a_comparison_goes_to_its_own_directory():
    assert default_out([Path("/r/demo")]) == Path("/r/demo/plots")
    assert default_out([Path("/r/gspo"), Path("/r/grpo")]) == Path("/r/plots-gspo-vs-grpo")


def test_the_evaluation_plot_starts_at_the_evaluation_before_training(tmp_path):
    """plots/eval.png lacked step 0: that evaluation is in eval.jsonl, not in a metrics row."""
    import json

    from gspo_mcore.run.plot import plot_runs

    rows = _rows(1e-7, 4)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    evals = [{"step": s, "version": f"step-{s}", "eval/toy/mean@4": 0.05 + 0.1 * s, "eval/toy/pass@4": 0.3}
             for s in (0, 4, 8)]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
    made = figures([rows], ["run"], [evals])
    line = next(l for l in made["eval"].axes[0].get_lines() if l.get_label().endswith("mean@4"))
    assert list(line.get_xdata()) == [0, 4, 8]
    assert (tmp_path / "plots" / "eval.png") in plot_runs([tmp_path], tmp_path / "plots")


def test_asynchronous_runs_get_staleness_and_idle_figures_and_a_shared_band_is_drawn_once():
    """Async runs had no staleness or idle plot; a comparison's mismatch plot drew three identical
    bands under a six-entry legend."""
    runs = [_rows(1e-3, seed) for seed in (5, 6, 7)]
    for rows in runs[1:]:
        for r in rows:
            r.update(staleness_mean=0.9, staleness_max=1, trainer_idle_fraction=0.1, engine_idle_fraction=0.2)
    made = figures(runs, ["sync", "async", "async-2"])
    assert {"staleness", "idle"} <= set(made)
    assert {line.get_label() for line in made["staleness"].axes[0].get_lines()} == {
        "async: staleness (versions), mean", "async-2: staleness (versions), mean", "async: max", "async-2: max"}
    labels = [line.get_label() for line in made["mismatch"].axes[0].get_lines()]
    assert labels.count("clip band (high)") == 1 and len(labels) == 4  # three runs' mismatch, one band
    assert "staleness" not in figures([_rows(1e-3, 8)], ["sync"])  # nothing to draw for a sync run alone


def test_the_idle_figure_of_a_sync_run_names_what_its_line_is():
    """A sync run has the engine's idle share only: its axis named the trainer."""
    rows = [{"step": s, "engine_idle_fraction": 0.5, "trainer_idle_fraction": None} for s in (1, 2, 3)]
    axis = figures([rows], ["sync"])["idle"].axes[0]
    assert axis.get_ylabel() == "idle share of the step"
    assert [line.get_label() for line in axis.get_lines()] == ["sync: engine"]
