"""Evaluation's arithmetic and inputs: the unbiased pass@k estimator against a hand-computed
table, the per-dataset figures, the config's checks, gspo-eval's model argument and table."""

import re

import pytest

from gspo_mcore.config import ConfigError, load_config
from gspo_mcore.common.errors import InputError
from gspo_mcore.evaluation.held_out import dataset_metrics, pass_at_k
from helpers import ScriptedClient

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
    ("eval.datasets=[{name: a, path: x, temperature: 0, samples: 1}]",
     "eval.datasets[0] (a): temperature 0 (greedy) runs single-turn only, not through rollout.function tool_loop"),
])
def test_eval_config_is_checked(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config("configs/tiny_cpu.yaml" if "greedy) runs" not in message else "configs/agent_cpu.yaml", [override])


def test_gspo_eval_takes_a_model_or_a_run_and_prints_a_table(tmp_path):
    from gspo_mcore.evaluation.cli import model_dir, table

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
    # The prompts counted, k named per row, mean@k with its standard error over the prompts
    # (means 0.5 and 1.0: sd 0.354 / sqrt 2), every pass@j.
    assert table(figures, ["toy"]).splitlines()[-1] == ("| toy | 2 | 2 | 0.750 ± 0.250 | 0.750 | 1.000 | 0.750 / 1.000 | "
                                                       "- | 3.0 | 1.0 |")


def test_gspo_eval_keeps_its_servers_logs():
    """They went to a temporary directory deleted afterwards."""
    from pathlib import Path

    from gspo_mcore.evaluation.cli import default_log_dir

    assert default_log_dir(Path("/nowhere/model")) == Path("gspo-eval-logs")


def _scripted_engine(tokenizer) -> ScriptedClient:
    """Answers the category the prompt asks for on even calls, over two servers."""

    def reply(name, prompt_ids):
        category = re.search(r"name an? (\w+)", tokenizer.decode(prompt_ids)).group(1)
        wrong = "fruit_1" if category == "color" else "color_1"
        return f"{category}_0" if int(name.split()[2].split("/")[0]) % 2 == 0 else wrong

    return ScriptedClient(tokenizer, reply, urls=["a", "b"], logprob=-0.5)


async def answer_once(task, engine):
    """A user's function: one turn, its text scored."""
    from gspo_mcore.batch.trajectory import Trajectory

    prompt = engine.chat_ids(task.messages)
    trajectory = Trajectory(prompt)
    trajectory.add_model(await engine.generate(prompt))
    trajectory.text = engine.tokenizer.decode(trajectory.token_ids, skip_special_tokens=True)
    return trajectory


async def answer_twice(task, engine):
    return [await answer_once(task, engine), await answer_once(task, engine)]


@pytest.mark.parametrize("function", ["answer_once", "answer_twice"])
def test_evaluation_runs_the_rollout_function_as_training_does(tmp_path, function):
    """With rollout.function set, each eval sample is one call of it (spread over the servers, on
    the version just pushed), scored on its trajectory's text; pass@k needs one trajectory per call."""
    from transformers import AutoTokenizer

    from gspo_mcore.evaluation.held_out import Evaluator
    from gspo_mcore.tasks.toy import make_prompts, make_tokenizer

    make_tokenizer(tmp_path / "tokenizer")
    make_prompts(tmp_path / "eval.jsonl", 3, seed=0)
    config = load_config(None, [f"data.tokenizer_dir={tmp_path / 'tokenizer'}", f"rollout.function=test_evaluation:{function}",
                                "reward.name=gspo_mcore.tasks.toy:category_reward", "reward.workers=1",
                                f"eval.datasets=[{{name: toy, path: {tmp_path / 'eval.jsonl'}, samples: 4}}]"])
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "tokenizer")
    engine = _scripted_engine(tokenizer)
    evaluator = Evaluator(config, tokenizer)
    try:
        if function == "answer_twice":
            with pytest.raises(InputError, match="returned 8 trajectories for 4 calls on eval dataset toy"):
                evaluator.run(engine, version="step-3")
            return
        metrics = evaluator.run(engine, version="step-3")
    finally:
        evaluator.close()
    assert len(engine.calls) == 12 and {c[2] for c in engine.calls} == {"step-3"}
    assert sorted({c[1] for c in engine.calls}) == [0, 1]  # one server per trajectory, both used
    # Calls 0, 2 of each prompt's 4 answer right: mean@4 0.5, every prompt solved within 4.
    assert metrics["eval/toy/mean@4"] == 0.5 and metrics["eval/toy/pass@4"] == 1.0
    assert metrics["eval/toy/response_length"] == 2
    # The samples show the whole trajectory (every turn, the environment's tokens too), not only
    # the text scored.
    sample = evaluator.last_samples[0]
    assert sample["transcript"] != sample["response"] and sample["response"] in sample["transcript"]


def test_a_runs_evaluation_logs_go_into_the_run(tmp_path):
    from gspo_mcore.evaluation.cli import default_log_dir

    (tmp_path / "checkpoints").mkdir()
    assert default_log_dir(tmp_path) == tmp_path / "logs" / "gspo-eval"
