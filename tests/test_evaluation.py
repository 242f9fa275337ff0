"""Evaluation's arithmetic and inputs: the unbiased pass@k estimator against a hand-computed
table, the per-dataset figures, the config's checks, gspo-eval's model argument and table."""

import json
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
                                                       "- | 3.0 | 1.0 | 0 | - |")
    cut = dataset_metrics("toy", [[1, 0], [1, 1]], [3, 3, 3, 3], greedy=False, seconds=1.0, truncated=1, no_program=2)
    assert (cut["eval/toy/truncated_fraction"], cut["eval/toy/no_program_fraction"]) == (0.25, 0.5)
    assert table(cut, ["toy"]).endswith("| 0 | truncated 25%, no program 50% |")
    assert "eval/toy/no_program_fraction" not in figures  # a reward that does not count programs


def test_gspo_eval_keeps_its_servers_logs_out_of_the_current_directory(tmp_path, monkeypatch):
    """They went to a temporary directory deleted afterwards, then to ./gspo-eval-logs (left in
    the repository's root): now a kept directory under the system's temporary directory."""
    import tempfile
    from pathlib import Path

    from gspo_mcore.evaluation.cli import default_log_dir

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    logs = default_log_dir(Path("/nowhere/model"))
    assert logs.is_dir() and logs.parent == tmp_path / "tmp" and logs.name.startswith("gspo-eval-logs-")
    assert not (tmp_path / "gspo-eval-logs").exists()


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


def _toy_evaluation(tmp_path, *overrides):
    """An Evaluator of 8 held-out toy prompts (4 samples each) on the scripted engine: a color
    prompt's samples 0 and 2 answer right, every other answer is wrong."""
    from transformers import AutoTokenizer

    from gspo_mcore.evaluation.held_out import Evaluator
    from gspo_mcore.tasks.toy import make_prompts, make_tokenizer
    from helpers import ScriptedEngine

    make_tokenizer(tmp_path / "tokenizer")
    make_prompts(tmp_path / "eval.jsonl", 8, seed=0)
    config = load_config(None, [f"data.tokenizer_dir={tmp_path / 'tokenizer'}", "reward.workers=1", *overrides,
                                f"eval.datasets=[{{name: toy, path: {tmp_path / 'eval.jsonl'}, samples: 4}}]"])
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "tokenizer")
    colors = sum('"answer": "color"' in line for line in (tmp_path / "eval.jsonl").read_text().splitlines())
    return Evaluator(config, tokenizer), ScriptedEngine(tokenizer), colors


def test_a_batched_reward_scores_the_evaluation_as_training(tmp_path):
    """reward.batched: the evaluation called it per response with strings: every call failed,
    silently, and scored 0 (mean@4 0.000 beside a training reward of 0.97)."""
    evaluator, engine, colors = _toy_evaluation(tmp_path, "reward.name=tests.reward_fixtures:category_group_reward",
                                                "reward.batched=true")
    try:
        metrics = evaluator.run(engine, version="step-0")
    finally:
        evaluator.close()
    assert colors >= 1 and metrics["eval/toy/mean@4"] == pytest.approx(colors * 2 / 32)
    assert metrics["eval/toy/pass@1"] == metrics["eval/toy/mean@4"] and metrics["eval/toy/reward_errors"] == 0


def test_each_evaluation_sample_is_seeded_by_the_dataset_the_weights_and_its_place(tmp_path):
    """A rerun evaluates the same samples (gspo_mcore.common.seeds.eval_seed); another version
    of the weights draws anew."""
    from gspo_mcore.common.seeds import eval_seed

    evaluator, engine, _ = _toy_evaluation(tmp_path, "reward.name=gspo_mcore.tasks.toy:category_reward",
                                           "train.seed=5")
    try:
        evaluator.run(engine, version="step-10")
        evaluator.run(engine, version="step-10")
        evaluator.run(engine, version="step-20")
    finally:
        evaluator.close()
    (_, first), (_, again), (_, later) = engine.calls
    assert first == again == [eval_seed(5, "toy", "step-10", p, k) for p in range(8) for k in range(4)]
    assert later == [eval_seed(5, "toy", "step-20", p, k) for p in range(8) for k in range(4)]


def test_an_evaluation_whose_reward_fails_says_so(tmp_path, capsys):
    """Failures were dropped: a reward that raised scored 0 with nothing said. Now: counted
    (eval/<name>/reward_errors), said on stderr with the first, and all of them failing stops it."""
    evaluator, engine, colors = _toy_evaluation(tmp_path, "reward.name=tests.reward_fixtures:category_or_raise")
    try:
        metrics = evaluator.run(engine, version="step-0")
    finally:
        evaluator.close()
    wrong = 32 - 2 * colors  # the reward raises on every wrong answer
    assert metrics["eval/toy/reward_errors"] == wrong and metrics["eval/toy/mean@4"] == pytest.approx(2 * colors / 32)
    said = capsys.readouterr().err
    assert (f"eval dataset toy: reward tests.reward_fixtures:category_or_raise: {wrong} of 32 responses not scored "
            "(each scored 0); the first: response ") in said and "RuntimeError: cannot score" in said
    from gspo_mcore.metrics.schema import unknown

    assert unknown(metrics) == []  # a figure of the schema's eval family

    evaluator, engine, _ = _toy_evaluation(tmp_path, "reward.name=tests.reward_fixtures:always_raises")
    try:
        with pytest.raises(InputError, match=r"^eval dataset toy: reward tests.reward_fixtures:always_raises: 32 of 32 "
                                             r"responses not scored \(all of them.*RuntimeError: this reward never works$"):
            evaluator.run(engine, version="step-0")
    finally:
        evaluator.close()


# ---- code: pass@1 on a LiveCodeBench window through gspo-eval

LCB_SAMPLE = "gspo_mcore/data/samples/lcb_window_sample.jsonl"
# Per problem of the window 2024-10-01..2025-02-28 (the shipped sample's three inside it): a
# right and a wrong program, and how many of the 4 samples are right.
PROGRAMS = {
    "countVowels": ("class Solution:\n    def countVowels(self, s):\n        return sum(c in 'aeiou' for c in s)\n",
                    "class Solution:\n    def countVowels(self, s):\n        return len(s)\n", 3),
    "largest of them": ("input()\nprint(max(map(int, input().split())))\n", "input()\nprint(0)\n", 2),
    "twoSmallest": ("class Solution:\n    def twoSmallest(self, nums):\n        return sorted(nums)[:2]\n",
                    "class Solution:\n    def twoSmallest(self, nums):\n        return nums[:2]\n", 1),
}


def byte_tokenizer(path):
    """A byte-level tokenizer (every text round-trips: programs keep their newlines) with a plain
    chat template, saved for AutoTokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<pad>")
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}assistant: {% endif %}")
    tokenizer.save_pretrained(path)
    return tokenizer


class ProgramEngine:
    """Answers each problem's first `right` samples (of 4) with its right program, the rest wrong."""

    urls, max_concurrency = ["scripted"], 4

    def __init__(self, tokenizer):
        self.tokenizer, self.loaded = tokenizer, []

    def load_from_disk(self, path, version):
        self.loaded.append((path, version))

    def client(self, vocab_size):
        return self

    def generate(self, prompts, params, weight_version=None, seeds=None, oldest_version=None, evaluation=False):
        from gspo_mcore.batch.rollout import Rollout

        out = []
        for i, prompt in enumerate(prompts):
            text = self.tokenizer.decode(prompt)
            right, wrong, count = next(v for key, v in PROGRAMS.items() if key in text)
            reply = f"Here it is.\n```python\n{right if i % 4 < count else wrong}```"
            cut = "twoSmallest" in text and i % 4 == 3  # its last sample ran out of tokens before any code
            ids = self.tokenizer.encode("Let me think" if cut else reply, add_special_tokens=False)
            ids += [] if cut else [self.tokenizer.eos_token_id]
            out.append(Rollout(list(prompt), ids, [-0.5] * len(ids), "length" if cut else "stop",
                               weight_version or "eval"))
        return out


def test_gspo_eval_reports_pass_at_1_on_a_livecodebench_window(tmp_path, monkeypatch, capsys):
    """prepare_code --since/--until cuts the window out of the shipped LiveCodeBench-format sample;
    gspo-eval scores k = 4 samples per problem with code_all in the sandbox: pass@1 is the mean
    over the samples (3/4, 2/4, 1/4 right: 1/2), pass@4 the problems solved at all. The table
    says what share was cut and held no program (it printed pass@1 alone), and the samples kept
    say why each wrong one scored 0."""
    import json
    import types

    from gspo_mcore.data.prepare_code import main as prepare_code
    from gspo_mcore.evaluation import cli
    from helpers import REPO

    window = tmp_path / "lcb_2410_2502.jsonl"
    assert prepare_code(["--input", str(REPO / LCB_SAMPLE), "--output", str(window),
                         "--since", "2024-10-01", "--until", "2025-02-28"]) == 0
    assert [json.loads(line)["question_id"] for line in window.read_text().splitlines()] == [
        "sample02_b", "sample03_a", "sample04_c"]
    tokenizer = byte_tokenizer(tmp_path / "tokenizer")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "eval.yaml").write_text(
        f"data: {{tokenizer_dir: {tmp_path / 'tokenizer'}}}\nreward: {{name: code, workers: 1, timeout_s: 60}}\n"
        f"eval:\n  datasets:\n    - {{name: lcb_2410_2502, path: {window}, reward: code_all, samples: 4, "
        "max_new_tokens: 512}\n")
    engine = ProgramEngine(tokenizer)
    evaluators = []

    class Kept(cli.Evaluator):
        def __init__(self, *args):
            super().__init__(*args)
            evaluators.append(self)

    monkeypatch.setattr(cli, "Evaluator", Kept)
    monkeypatch.setattr(cli.engines, "connect", lambda config, urls, key: engine)
    monkeypatch.setattr(cli, "load_hf_config", lambda path: types.SimpleNamespace(vocab_size=len(tokenizer)))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["--config", str(tmp_path / "eval.yaml"), "--model", str(tmp_path / "model"),
                     "--urls", "http://scripted:1"]) == 0
    assert engine.loaded == [(tmp_path / "model", "eval")]
    printed = capsys.readouterr().out.splitlines()
    figures = json.loads(printed[-1])
    assert figures["eval/lcb_2410_2502/pass@1"] == pytest.approx(1 / 2)
    assert figures["eval/lcb_2410_2502/truncated_fraction"] == figures["eval/lcb_2410_2502/no_program_fraction"] == 1 / 12
    assert printed[-2].endswith("| 0 | truncated 8%, no program 8% |")
    kept = evaluators[0].last_samples  # countVowels' four: the fourth wrong (len(s) is not the vowels)
    assert [s["reward"] for s in kept] == [1.0, 1.0, 1.0, 0.0] and ["reason" in s for s in kept] == [False] * 3 + [True]
    why = kept[3]["reason"]
    assert why["verdict"] == "wrong" and why["got"] != why["expected"]
    assert figures["eval/lcb_2410_2502/pass@1"] == figures["eval/lcb_2410_2502/mean@4"]
    assert figures["eval/lcb_2410_2502/pass@4"] == 1.0 and figures["eval/lcb_2410_2502/reward_errors"] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval.yaml", "lcb_2410_2502.jsonl", "model", "tokenizer"]


def test_the_30b_code_recipe_evaluates_pass_at_1_on_a_named_livecodebench_window():
    """Its eval dataset is the window its header's prepare_code command cuts, scored on every test."""
    from helpers import REPO

    path = REPO / "configs" / "qwen3_30b_a3b_gspo_code.yaml"
    (dataset,) = load_config(str(path)).eval.datasets
    command = next(line for line in path.read_text().splitlines() if "--since" in line)
    since, until = re.search(r"--since (\S+) --until (\S+)", command).groups()
    assert f"--output {dataset.path}" in command and dataset.reward == "code_all"
    assert dataset.name == f"lcb_{since[2:4]}{since[5:7]}_{until[2:4]}{until[5:7]}" and dataset.samples >= 4


def test_gspo_eval_seeds_a_runs_model_as_the_runs_last_evaluation(tmp_path):
    """`gspo-eval --model RUN` (or RUN/hf) printed 0.938 where the run's own last evaluation said
    0.969: its seeds hash the weight version, and none was passed. Now the run's last evaluation's
    version and the run's train.seed (its config.yaml); a latest checkpoint converted takes its own
    step's row; any other model says it has no version."""
    from gspo_mcore.evaluation.cli import run_seeds

    run = tmp_path / "run"
    (run / "hf").mkdir(parents=True)
    (run / "config.yaml").write_text("train:\n  seed: 77\n")
    (run / "eval.jsonl").write_text(json.dumps({"step": 0, "version": "step-0", "eval/toy/mean@4": 0.3}) + "\n"
                                    + json.dumps({"step": 40, "version": "step-40", "eval/toy/mean@4": 0.969}) + "\n")
    for model in (run, run / "hf"):
        seed, version, said = run_seeds(model, run / "hf", 1234)
        assert (seed, version) == (77, "step-40") and "the run's last evaluation" in said
    step = run / "checkpoints" / "step_000020"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text(json.dumps({"step": 20}))
    (run / "checkpoints" / "latest").write_text("step_000020")
    assert run_seeds(run, tmp_path / "scratch" / "hf", 1234)[:2] == (77, None)  # step 20 was not evaluated
    other = tmp_path / "model"
    other.mkdir()
    assert run_seeds(other, other, 1234) == (1234, None, "train.seed 1234, no weight version (not a run's model)")


def test_a_seeded_as_version_seeds_without_being_required_of_the_responses(tmp_path):
    """Evaluator.run(seeded_as=...): the samples' seeds are the named version's, the responses
    need not come from it (gspo-eval's servers load the weights under a version of their own)."""
    from gspo_mcore.common.seeds import eval_seed

    evaluator, engine, _ = _toy_evaluation(tmp_path, "reward.name=gspo_mcore.tasks.toy:category_reward",
                                           "train.seed=5")
    engine.version = 3  # its own weights: a required version "step-40" would refuse every response
    try:
        evaluator.run(engine, seeded_as="step-40")
    finally:
        evaluator.close()
    ((_, seeds),) = engine.calls
    assert seeds == [eval_seed(5, "toy", "step-40", p, k) for p in range(8) for k in range(4)]
