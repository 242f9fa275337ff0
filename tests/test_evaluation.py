"""Evaluation's arithmetic and inputs: the unbiased pass@k estimator against a hand-computed
table, the per-dataset figures, the config's checks, gspo-eval's model argument and table."""

import re

import pytest

from gspo_mcore.config import ConfigError, load_config
from gspo_mcore.errors import InputError
from gspo_mcore.evaluation import dataset_metrics, pass_at_k

# n = 4 samples, c correct: 1 - C(4 - c, k) / C(4, k), by hand.
HAND = {0: [0, 0, 0, 0], 1: [1 / 4, 1 / 2, 3 / 4, 1], 2: [1 / 2, 5 / 6, 1, 1], 3: [3 / 4, 1, 1, 1], 4: [1, 1, 1, 1]}


@pytest.mark.parametrize("c", sorted(HAND))
def test_pass_at_k_is_the_unbiased_estimator(c):
    assert [pass_at_k(4, c, k) for k in (1, 2, 3, 4)] == pytest.approx(HAND[c], abs=1e-12)


def test_dataset_figures_mean_at_k_pass_at_k_and_greedy():
    rewards = [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]]
    out = dataset_metrics("math", rewards, [10, 20] * 6, greedy=False, seconds=2.5)
    assert out["eval/math/mean@4"] == pytest.approx(3 / 12)
    assert out["eval/math/pass@1"] == pytest.approx(out["eval/math/mean@4"])  # 0/1 rewards
    assert out["eval/math/pass@2"] == pytest.approx((1 / 2 + 5 / 6 + 0) / 3)
    assert out["eval/math/pass@4"] == pytest.approx(2 / 3) and "eval/math/greedy" not in out
    assert out["eval/math/response_length"] == 15 and out["eval/math/time_s"] == 2.5
    partial = dataset_metrics("p", [[0.5, 1.0]], [3, 3], greedy=False, seconds=0)
    assert partial["eval/p/mean@2"] == 0.75 and partial["eval/p/pass@1"] == 0.5  # correct: reward >= 1
    greedy = dataset_metrics("g", [[1.0], [0.0]], [1, 1], greedy=True, seconds=0)
    assert greedy["eval/g/greedy"] == 0.5


@pytest.mark.parametrize("override, message", [
    ("eval.datasets=[{name: a/b, path: x}]", "eval.datasets[0]: needs a name (no '/') and a path"),
    ("eval.datasets=[{name: a, path: x, temperature: 0, samples: 4}]", "temperature 0 (greedy) gives one answer"),
    ("eval.datasets=[{name: a, path: x}, {name: a, path: y}]", "eval.datasets: names must differ"),
    ("eval.every=-1", "eval.every: must be >= 0"),
])
def test_eval_config_is_checked(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config("configs/tiny_cpu.yaml", [override])


def test_gspo_eval_takes_a_model_or_a_run_and_prints_a_table(tmp_path):
    from gspo_mcore.evaluate import model_dir, table

    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(InputError, match="a run without an exported hf/: give model.hf_dir"):
        model_dir(tmp_path / "run")
    with pytest.raises(InputError, match="^[^e].*config.json not found"):  # the converter's own one line
        model_dir(tmp_path / "run", tmp_path / "scratch", str(tmp_path))
    with pytest.raises(InputError, match="neither a Hugging Face model directory"):
        model_dir(tmp_path)
    (tmp_path / "run" / "hf").mkdir()
    (tmp_path / "run" / "hf" / "config.json").write_text("{}")
    assert model_dir(tmp_path / "run") == tmp_path / "run" / "hf"
    figures = dataset_metrics("toy", [[1, 0], [1, 1]], [3, 3, 3, 3], greedy=False, seconds=1.0)
    assert table(figures, ["toy"]).splitlines()[-1] == "| toy | 0.750 (k=2) | 0.750 | 1.000 | - | 3.0 | 1.0 |"
