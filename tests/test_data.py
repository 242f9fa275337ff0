import json
import re
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers import REPO
from gspo_mcore.data import PromptDataset, PromptSampler, chat_prompt_ids
from gspo_mcore.data.prepare_math import INSTRUCTION, prepare
from gspo_mcore.common.errors import InputError
from gspo_mcore.rewards.answers import math_reward

SAMPLE = REPO / "gspo_mcore" / "data" / "samples" / "math_lighteval_sample.jsonl"


def test_prepare_math_sample(tmp_path):
    out = tmp_path / "math.jsonl"
    assert prepare(SAMPLE, out) == 10
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[1]["answer"] == r"\frac{5}{6}" and rows[1]["level"] == "Level 1"
    assert rows[0]["prompt"].startswith("What is $1+1$?") and r"\boxed{}" in rows[0]["prompt"]
    dataset = PromptDataset.load(out)
    assert len(dataset) == 10 and dataset[7].messages == [{"role": "user", "content": rows[7]["prompt"]}]
    # The extracted answers are what the math reward accepts.
    assert all(math_reward(rf"\boxed{{{r['answer']}}}", r["answer"]) == 1.0 for r in rows)


def test_prepare_math_takes_an_aime_style_row(tmp_path):
    """`problem` and `answer`, no `solution` (AIME): the answer as given, the other fields kept."""
    aime = tmp_path / "aime.parquet"
    pq.write_table(pa.Table.from_pylist([{"id": 60, "problem": "Find $x$.", "answer": "033", "year": 2024},
                                         {"id": 61, "problem": "Find $y$.", "answer": "204", "year": 2024}]), aime)
    assert prepare(aime, tmp_path / "aime.jsonl") == 2
    rows = [json.loads(line) for line in (tmp_path / "aime.jsonl").read_text().splitlines()]
    assert rows[0] == {"prompt": f"Find $x$.\n\n{INSTRUCTION}", "answer": "033", "id": 60, "year": 2024}
    assert rows[1]["answer"] == "204"
    sample = PromptDataset.load(tmp_path / "aime.jsonl")[0]
    assert sample.metadata == {"id": 60, "year": 2024} and sample.prompt.startswith("Find $x$.")
    assert math_reward(r"so \boxed{33}", sample.answer) == 1.0
    (tmp_path / "neither.jsonl").write_text(json.dumps({"problem": "p"}) + "\n")
    with pytest.raises(InputError, match=r"neither.jsonl:1: missing field 'answer' \(or 'solution' with a"):
        prepare(tmp_path / "neither.jsonl", tmp_path / "o.jsonl")


def test_prepare_math_takes_the_published_eval_files_as_downloaded(tmp_path):
    """MATH-500's test.jsonl (answer beside the solution) and AIME 2024's capitalised columns."""
    math500 = tmp_path / "test.jsonl"
    math500.write_text(json.dumps({"problem": "Compute $2+3$.", "solution": r"So \boxed{5}.", "answer": "5",
                                   "subject": "Prealgebra", "level": 1, "unique_id": "test/prealgebra/1.json"}) + "\n")
    assert prepare(math500, tmp_path / "math500.jsonl") == 1
    row = json.loads((tmp_path / "math500.jsonl").read_text())
    assert row["answer"] == "5" and row["unique_id"] == "test/prealgebra/1.json" and "solution" not in row
    aime = tmp_path / "aime_2024.parquet"
    pq.write_table(pa.Table.from_pylist([{"ID": "2024-I-1", "Problem": "Find $n$.", "Solution": r"\boxed{204}",
                                          "Answer": 204}]), aime)
    assert prepare(aime, tmp_path / "aime.jsonl") == 1
    row = json.loads((tmp_path / "aime.jsonl").read_text())
    assert row == {"prompt": f"Find $n$.\n\n{INSTRUCTION}", "answer": "204", "ID": "2024-I-1"}


def test_prepare_math_cli_errors_name_the_row(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"problem": "p", "solution": "no box"}) + "\n")
    proc = subprocess.run([sys.executable, "-m", "gspo_mcore.data.prepare_math", "--input", str(bad),
                           "--output", str(tmp_path / "o.jsonl")], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2 and f"{bad}:1: solution has no complete" in proc.stderr
    assert not list(tmp_path.glob("o.jsonl*"))


def test_parquet_and_chat_messages(tmp_path):
    path = tmp_path / "d.parquet"
    table = pa.Table.from_pylist([
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}],
         "answer": "4", "source": "x"},
    ])
    pq.write_table(table, path)
    sample = PromptDataset.load(path)[0]
    assert sample.messages[1]["content"] == "2+2?" and sample.answer == "4" and sample.metadata == {"source": "x"}


def test_a_verl_parquet_and_a_slime_jsonl_load_as_they_are(tmp_path):
    """verl's schema (examples/data_preprocess/gsm8k.py): `prompt` a chat, the answer in
    `reward_model.ground_truth`, `data_source`, `ability`, `extra_info`; slime's `--label-key label`."""
    chat = [{"role": "user", "content": "Natalia sold 48 clips ... How many? Let's think step by step."}]
    verl = {"data_source": "openai/gsm8k", "prompt": chat, "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": "72"}, "extra_info": {"split": "train", "index": 0}}
    pq.write_table(pa.Table.from_pylist([verl]), tmp_path / "train.parquet")
    sample = PromptDataset.load(tmp_path / "train.parquet")[0]
    assert sample.messages == chat and sample.answer == "72" and sample.prompt == chat[0]["content"]
    assert sample.metadata == {k: v for k, v in verl.items() if k != "prompt"}  # a reward may ask for any of them
    # The nested key named: the same answer; another nested field as the prompt.
    assert PromptDataset.load(tmp_path / "train.parquet", answer_key="reward_model.ground_truth")[0].answer == "72"
    nested = {"question": {"text": "2+2?"}, "solution": {"final": 4}}
    (tmp_path / "nested.jsonl").write_text(json.dumps(nested) + "\n")
    sample = PromptDataset.load(tmp_path / "nested.jsonl", prompt_key="question.text", answer_key="solution.final")[0]
    assert sample.prompt == "2+2?" and sample.answer == "4"
    slime = {"prompt": [{"role": "system", "content": "Box it."}, {"role": "user", "content": "1+1?"}], "label": "2"}
    (tmp_path / "dapo.jsonl").write_text(json.dumps(slime) + "\n")
    sample = PromptDataset.load(tmp_path / "dapo.jsonl")[0]
    assert sample.messages == slime["prompt"] and sample.answer == "2" and sample.metadata == {}


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"prompt": "x"}\n', "d.jsonl:1: missing field 'answer' (nor verl's 'reward_model.ground_truth' nor slime's 'label'"),
        ('{"prompt": [{"role": "user"}], "answer": "1"}\n', "field 'prompt' must be a string or a list of {role, content}"),
        ('{"answer": "1"}\n', "d.jsonl:1: missing field 'prompt' (or 'messages')"),
        ('{"prompt": "x", "answer": 1}\n{oops\n', "d.jsonl:2: not valid JSON"),
        ('{"messages": "hi", "answer": 1}\n', "must be a list of {role, content}"),
    ],
)
def test_bad_records_name_file_and_line(tmp_path, content, message):
    (tmp_path / "d.jsonl").write_text(content)
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)").replace("{", r"\{").replace("}", r"\}")):
        PromptDataset.load(tmp_path / "d.jsonl")


def test_sampler_is_deterministic_and_resumes_exactly():
    a = PromptSampler(10, seed=3)
    first = [a.next_indices(4) for _ in range(6)]  # crosses epoch boundaries
    assert sorted(first[0] + first[1] + first[2][:2]) == list(range(10))  # epoch 0 is a permutation
    b = PromptSampler(10, seed=3)
    b.next_indices(4), b.next_indices(4)
    state = b.state_dict()
    c = PromptSampler(10, seed=3)
    c.load_state_dict(state)
    assert [c.next_indices(4) for _ in range(4)] == first[2:]
    assert PromptSampler(10, seed=4).next_indices(10) != first[0] + first[1] + first[2][:2]
    with pytest.raises(ValueError, match="seed 3 / 10 samples"):
        PromptSampler(11, seed=3).load_state_dict(state)


def test_chat_template_ids():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "<user>", "<assistant>", "<end>", "2+2?", "be", "brief"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} <end> {% endfor %}"
        "{% if add_generation_prompt %}<assistant> {% endif %}"
    )
    ids = chat_prompt_ids(tokenizer, [{"role": "user", "content": "2+2?"}])
    assert ids == [1, 4, 3, 2]
    # data.chat_template_kwargs: the template's own variables (Qwen3's enable_thinking).
    tokenizer.chat_template += "{% if enable_thinking is defined and not enable_thinking %}<end> {% endif %}"
    assert chat_prompt_ids(tokenizer, [{"role": "user", "content": "2+2?"}]) == [1, 4, 3, 2]
    assert chat_prompt_ids(tokenizer, [{"role": "user", "content": "2+2?"}], {"enable_thinking": False}) == [1, 4, 3, 2, 3]



def test_the_data_pages_verl_row_loads_from_parquet_as_it_says(tmp_path):
    from helpers import REPO

    text = (REPO / "docs" / "05-data-and-rewards.md").read_text()
    row = json.loads(re.search(r"```json\n(.*?)```", text, re.S).group(1))
    pq.write_table(pa.Table.from_pylist([row]), tmp_path / "verl.parquet")
    sample = PromptDataset.load(tmp_path / "verl.parquet")[0]
    assert sample.messages == row["prompt"] and sample.answer == "72" and len(sample.metadata) == 4


# ---- prepare_code: what it writes, LiveCodeBench's date window

LCB_SAMPLE = REPO / "gspo_mcore" / "data" / "samples" / "lcb_window_sample.jsonl"


def test_prepare_code_cuts_a_livecodebench_window_on_contest_date(tmp_path):
    """--since / --until, both days included at 00:00 as LiveCodeBench's own --start_date /
    --end_date; a row without a readable date, or a window with nothing in it, is one line."""
    from datetime import datetime

    from gspo_mcore.data.prepare_code import prepare

    out = tmp_path / "window.jsonl"
    assert prepare(LCB_SAMPLE, out, since=datetime(2024, 10, 1), until=datetime(2025, 2, 28)) == 3
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["contest_date"][:10] for r in rows] == ["2024-11-16", "2025-01-11", "2025-02-22"]
    assert prepare(LCB_SAMPLE, out, since=datetime(2025, 2, 22)) == 3  # the day itself is in
    assert prepare(LCB_SAMPLE, out, until=datetime(2024, 8, 3)) == 1
    assert prepare(LCB_SAMPLE, out) == 6  # no window: every problem
    undated = tmp_path / "undated.jsonl"
    undated.write_text(LCB_SAMPLE.read_text().splitlines()[0] + "\n" + json.dumps({"contest_date": "soon"}) + "\n")
    with pytest.raises(InputError, match=r"^\S+undated.jsonl:2: field 'contest_date': not an ISO date \('soon'\)$"):
        prepare(undated, out, since=datetime(2024, 1, 1))
    with pytest.raises(InputError, match=r"no problems with a contest_date in \[2030-01-01 00:00:00, -\] \(6 rows read\)"):
        prepare(LCB_SAMPLE, tmp_path / "none.jsonl", since=datetime(2030, 1, 1))
    assert not (tmp_path / "none.jsonl").exists()


def test_prepare_code_says_what_it_writes_and_takes_the_window_on_its_command_line(tmp_path, capsys):
    from gspo_mcore.data.prepare_code import main

    with pytest.raises(SystemExit) as shown:
        main(["--help"])
    said = capsys.readouterr().out
    assert shown.value.code == 0 and said.startswith("usage: python -m gspo_mcore.data.prepare_code")
    assert "answer    what the reward needs" in said and "not its\n            tests, its question or its solutions" in said
    assert "--since YYYY-MM-DD" in said
    assert main(["--input", str(LCB_SAMPLE), "--output", str(tmp_path / "o.jsonl"), "--until", "2024-12-31"]) == 0
    assert len((tmp_path / "o.jsonl").read_text().splitlines()) == 2
    with pytest.raises(SystemExit) as refused:
        main(["--input", str(LCB_SAMPLE), "--output", str(tmp_path / "o.jsonl"), "--since", "2025/01/01"])
    assert refused.value.code == 2 and "argument --since: '2025/01/01': expected a date YYYY-MM-DD" in capsys.readouterr().err


def test_prepare_code_rows_carry_the_tests_not_the_solutions(tmp_path):
    """A CodeContests row holds hundreds of solutions (and incorrect ones): they were copied into
    every prompt row. The reward reads `answer` only."""
    from gspo_mcore.data.prepare_code import prepare

    contests = {"name": "1A", "description": "Add.", "difficulty": 7,
                "public_tests": {"input": ["1 2\n"], "output": ["3\n"]},
                "solutions": {"language": [3, 2], "solution": ["print(3)", "int main(){}"]},
                "incorrect_solutions": {"language": [3], "solution": ["print(4)"]}}
    prime = {"prompt": "Add.", "gold_standard_solution": "```python\nprint(3)\n```", "problem_id": "p1",
             "verification_info": {"test_cases": [{"type": "stdin_stdout", "input": "1 2\n", "output": "3\n"}]}}
    (tmp_path / "rows.jsonl").write_text(json.dumps(contests) + "\n" + json.dumps(prime) + "\n")
    assert prepare(tmp_path / "rows.jsonl", tmp_path / "out.jsonl") == 2
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert sorted(rows[0]) == ["answer", "difficulty", "messages", "name"]
    assert sorted(rows[1]) == ["answer", "messages", "problem_id"]
    assert json.loads(rows[0]["answer"])["tests"] == [["1 2\n", "3\n"]]


def test_an_object_answer_reaches_the_reward_as_json(tmp_path):
    """verl's ground truth as a Parquet struct was turned into Python's repr (single quotes),
    which no reward parses."""
    truth = {"inputs": ["1 2\n"], "outputs": ["3\n"]}
    pq.write_table(pa.Table.from_pylist([{"prompt": [{"role": "user", "content": "Add."}],
                                          "reward_model": {"style": "rule", "ground_truth": truth}}]),
                   tmp_path / "verl.parquet")
    sample = PromptDataset.load(tmp_path / "verl.parquet")[0]
    assert json.loads(sample.answer) == truth and sample.where == f"{tmp_path / 'verl.parquet'} row 0"
