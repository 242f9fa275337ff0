"""The long task (gspo_mcore/tasks/long.py): its reward counts every word, and its writer is
deterministic and leaves no half-written task directory. No servers."""

import json
import random

import pytest

from gspo_mcore.tasks import long as long_task

from gspo_mcore.tasks import toy as toy_task
from gspo_mcore.tasks.long import RESPONSE_WORDS, list_reward, make_long_task, make_prompts


def words(category: str, count: int, start: int = 0) -> list[str]:
    return [f"{category}_{(start + i) % toy_task.WORDS_PER_CATEGORY}" for i in range(count)]


@pytest.mark.parametrize("response, expected", [
    (" ".join(words("animal", 40)), 1.0),
    (" ".join(words("animal", 40) + words("color", 10)), 1.0),  # words past the count do not matter
    (" ".join(words("animal", 30) + words("fruit", 10)), 0.75),
    (" ".join(words("fruit", 10) + words("animal", 30)), 0.75),  # the position of a wrong word does not matter
    (" ".join(words("animal", 20)), 0.5),                          # stopped early: the missing 20 count as wrong
    (" ".join(["animal"] * 40), 0.0),                              # the category's name is not one of its words
    ("", 0.0),
])
def test_reward_is_the_fraction_of_the_first_n_words_in_the_category(response, expected):
    assert list_reward(response, "animal 40") == pytest.approx(expected)


def test_reward_reads_the_count_from_the_answer():
    assert list_reward(" ".join(words("color", 4)), "color 8") == pytest.approx(0.5)
    assert list_reward(" ".join(words("color", 4)), "color 4") == pytest.approx(1.0)


def test_a_uniformly_random_response_scores_60_of_256():
    vocabulary = toy_task.vocabulary()
    rng = random.Random(0)
    scores = [list_reward(" ".join(rng.choices(vocabulary, k=RESPONSE_WORDS)), f"number {RESPONSE_WORDS}")
              for _ in range(2000)]
    assert sum(scores) / len(scores) == pytest.approx(60 / 256, abs=0.01)


def test_prompts_are_the_toy_tasks_with_the_count(tmp_path):
    make_prompts(tmp_path / "long.jsonl", 50, seed=3, words=32)
    toy_task.make_prompts(tmp_path / "toy.jsonl", 50, seed=3)
    long = [json.loads(line) for line in (tmp_path / "long.jsonl").read_text().splitlines()]
    toy = [json.loads(line) for line in (tmp_path / "toy.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in long] == [r["prompt"] for r in toy]
    assert [r["answer"] for r in long] == [f"{r['answer']} 32" for r in toy]
    make_prompts(tmp_path / "again.jsonl", 50, seed=3, words=32)
    make_prompts(tmp_path / "other.jsonl", 50, seed=4, words=32)
    assert (tmp_path / "again.jsonl").read_bytes() == (tmp_path / "long.jsonl").read_bytes()
    assert (tmp_path / "other.jsonl").read_bytes() != (tmp_path / "long.jsonl").read_bytes()


def test_writer_is_deterministic_and_its_tokenizer_feeds_the_reward(tmp_path):
    from transformers import AutoTokenizer

    first, second = make_long_task(tmp_path / "a", num_prompts=20), make_long_task(tmp_path / "b", num_prompts=20)
    for name in ("prompts.jsonl", "model/model.safetensors", "model/config.json", "model/tokenizer.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]  # no temporary left
    record = json.loads((first / "prompts.jsonl").read_text().splitlines()[0])
    category = record["answer"].split()[0]
    tokenizer = AutoTokenizer.from_pretrained(first / "model")
    # What the trainer scores: the response's ids (stop token included) decoded without specials.
    ids = tokenizer.convert_tokens_to_ids(words(category, RESPONSE_WORDS - 1) + ["<eos>"])
    text = tokenizer.decode(ids, skip_special_tokens=True)
    assert list_reward(text, record["answer"]) == pytest.approx((RESPONSE_WORDS - 1) / RESPONSE_WORDS)


def test_writer_leaves_no_partial_task_and_keeps_a_complete_one(tmp_path, monkeypatch):
    out = tmp_path / "task"

    def broken(path, count, seed):
        raise OSError("disk full")

    monkeypatch.setattr(long_task.toy, "make_prompts", broken)
    with pytest.raises(OSError):
        make_long_task(out, num_prompts=5)
    assert not out.exists()
    monkeypatch.undo()
    make_long_task(out, num_prompts=5)
    assert len((out / "prompts.jsonl").read_text().splitlines()) == 5
    (out / "prompts.jsonl").write_text('{"prompt": "kept", "answer": "color 40"}\n')
    make_long_task(out, num_prompts=5)
    assert (out / "prompts.jsonl").read_text() == '{"prompt": "kept", "answer": "color 40"}\n'


def test_a_missing_cpu_task_names_the_command_that_writes_it(tmp_path, monkeypatch):
    """configs/long_cpu.yaml reads outputs/long_task: a run without it is told the command, and
    that command (run as told) writes what the config reads."""
    import runpy
    import shlex
    import sys
    import warnings

    from helpers import REPO
    from gspo_mcore.config import load_config
    from gspo_mcore.common.errors import InputError
    from gspo_mcore.tasks.toy import check_task_written

    monkeypatch.chdir(tmp_path)  # the config's paths are relative to where the run starts
    config = load_config(REPO / "configs" / "long_cpu.yaml")
    with pytest.raises(InputError) as err:
        check_task_written(config)
    message = str(err.value)
    assert message == ("model.hf_dir: outputs/long_task/model not found; write the task first: "
                       "python -m gspo_mcore.tasks.long outputs/long_task")
    python, _, module, *args = shlex.split(message.split("write the task first: ")[1])
    monkeypatch.setattr(sys, "argv", [module, *args])
    with warnings.catch_warnings():  # runpy: the module is imported already (by gspo_mcore.tasks.toy's users)
        warnings.simplefilter("ignore", RuntimeWarning)
        runpy.run_module(module, run_name="__main__")
    check_task_written(config)  # written: nothing missing
    assert (tmp_path / config.data.path).is_file()


@pytest.mark.parametrize("name", ["tiny_cpu", "long_cpu"])
def test_a_cpu_configs_evaluation_reads_its_own_tasks_held_out_prompts(name):
    """long_cpu inherited tiny_cpu's evaluation set: it failed without the demo's toy task."""
    from pathlib import Path

    from gspo_mcore.config import load_config

    config = load_config(Path(__file__).resolve().parent.parent / "configs" / f"{name}.yaml")
    task = Path(config.data.path).parent
    assert config.eval.datasets and all(Path(d.path).parent == task for d in config.eval.datasets)
    assert all(d.max_new_tokens == config.rollout.max_new_tokens for d in config.eval.datasets)
