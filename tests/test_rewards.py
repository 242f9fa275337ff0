import pytest

from gspo_mcore.errors import InputError
from gspo_mcore.rewards import load_reward_fn
from gspo_mcore.rewards.answers import exact_match_reward, last_boxed, math_reward
from gspo_mcore.rewards.runner import RewardRunner


def test_last_boxed_balances_braces():
    assert last_boxed(r"first \boxed{1} then \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert last_boxed("no box") is None
    assert last_boxed(r"cut off \boxed{\frac{1}{2") is None


@pytest.mark.parametrize(
    "response, answer, expected",
    [
        (r"so the answer is $\boxed{\frac{1}{2}}$", "0.5", 1.0),
        (r"$\boxed{0.5}$", r"\frac{1}{2}", 1.0),
        (r"$\boxed{2\sqrt{2}}$", r"\sqrt{8}", 1.0),
        (r"$\boxed{3}$", "4", 0.0),
        ("4 but never boxed", "4", 0.0),
    ],
)
def test_math_reward(response, answer, expected):
    assert math_reward(response, answer) == expected


def test_exact_match():
    assert exact_match_reward(r"... \boxed{ 42 }", "42") == 1.0
    assert exact_match_reward("  hello   world ", "hello world") == 1.0
    assert exact_match_reward("hello", "world") == 0.0


def test_import_path_and_errors():
    assert load_reward_fn("tests.reward_fixtures:length_reward")("abc", "") == 3.0
    with pytest.raises(InputError, match="nor 'module:function'"):
        load_reward_fn("fuzzy")
    with pytest.raises(InputError, match="cannot import"):
        load_reward_fn("tests.reward_fixtures:missing")


def test_runner_scores_and_counts_crashes_and_timeouts():
    runner = RewardRunner("tests.reward_fixtures:moody_reward", timeout_s=2.0, workers=2)
    try:
        responses = ["ok", "crash", "hang", "ok", "nan", "ok"]  # a NaN counts as a failure, like a raise
        rewards, stats = runner.score(responses, ["1"] * 6)
        assert rewards == [1.0, 0.0, 0.0, 1.0, 0.0, 1.0]
        assert (stats.errors, stats.timeouts) == (2, 1)
        rewards, stats = runner.score(["ok"], ["1"])  # a fresh pool after the timeout
        assert rewards == [1.0] and (stats.errors, stats.timeouts) == (0, 0)
    finally:
        runner.close()


def test_runner_math_reward():
    runner = RewardRunner("math", timeout_s=30.0, workers=1)
    try:
        rewards, _ = runner.score([r"\boxed{\frac{2}{4}}", r"\boxed{7}"], ["0.5", "8"])
        assert rewards == [1.0, 0.0]
    finally:
        runner.close()
