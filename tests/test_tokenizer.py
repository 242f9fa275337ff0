"""gspo_mcore.data.tokenizer.load_tokenizer gives what AutoTokenizer gives (class, ids, chat
template, special tokens) for the task writers' tokenizers, without importing AutoTokenizer; other
directories go through AutoTokenizer itself."""

import json
import subprocess
import sys

import pytest

from gspo_mcore.data.tokenizer import GENERIC_BACKEND_KEPT, _generic_backend, load_tokenizer
from gspo_mcore.tasks import agent, toy
from helpers import REPO, environment

CONVERSATION = [{"role": "user", "content": "name a fruit ( fruit_1 animal_2 )"},
                {"role": "assistant", "content": "fruit"}, {"role": "user", "content": "again ?"}]


def tokenizer_dir(root, model_type, words=None, template=toy.CHAT_TEMPLATE):
    toy.make_tokenizer(root, words, template)
    (root / "config.json").write_text(json.dumps({"model_type": model_type}))
    return root


def same_tokenizer(ours, theirs, texts):
    assert type(ours) is type(theirs) and len(ours) == len(theirs)
    assert ours.chat_template == theirs.chat_template
    assert ours.all_special_tokens == theirs.all_special_tokens and ours.all_special_ids == theirs.all_special_ids
    assert (ours.eos_token_id, ours.pad_token_id, ours.unk_token_id) == (
        theirs.eos_token_id, theirs.pad_token_id, theirs.unk_token_id)
    for text in texts:
        ids = ours.encode(text, add_special_tokens=True)
        assert ids == theirs.encode(text, add_special_tokens=True) and ours.decode(ids) == theirs.decode(ids)
    for messages in (CONVERSATION[:1], CONVERSATION):
        for generation_prompt in (True, False):
            assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt) == (
                theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt))
            assert ours.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt) == (
                theirs.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt))


@pytest.mark.parametrize("task", ["toy", "agent"])
def test_the_task_writers_tokenizers_load_as_autotokenizer_loads_them(tmp_path, task):
    from transformers import AutoTokenizer

    words, template = (None, toy.CHAT_TEMPLATE) if task == "toy" else (agent.vocabulary(), agent.CHAT_TEMPLATE)
    path = tokenizer_dir(tmp_path, "qwen3_moe", words, template)
    assert _generic_backend(path)  # the direct path is the one taken
    texts = ["name a fruit ( fruit_1 animal_2 )", "<eos> words nobody wrote <pad>", "", "  spaced   out  "]
    same_tokenizer(load_tokenizer(path), AutoTokenizer.from_pretrained(path), texts)


def test_the_rule_holds_in_the_installed_transformers():
    """AutoTokenizer keeps a tokenizer_config.json's generic backend unless the model type is one
    whose hub class it overrides: the types the direct path serves are not."""
    from transformers.models.auto.tokenization_auto import MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS

    assert GENERIC_BACKEND_KEPT and not GENERIC_BACKEND_KEPT & set(MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS)


def test_other_directories_go_through_autotokenizer(tmp_path):
    """A model type whose hub class AutoTokenizer overrides (qwen2), a missing or unreadable
    config.json, a remote-code tokenizer: AutoTokenizer's own answer."""
    from transformers import AutoTokenizer

    qwen2 = tokenizer_dir(tmp_path / "qwen2", "qwen2")
    assert not _generic_backend(qwen2)
    assert type(load_tokenizer(qwen2)) is type(AutoTokenizer.from_pretrained(qwen2))
    bare = tokenizer_dir(tmp_path / "bare", "qwen3_moe")
    (bare / "config.json").unlink()
    assert not _generic_backend(bare)
    (bare / "config.json").write_text("{not json")
    assert not _generic_backend(bare)
    remote = tokenizer_dir(tmp_path / "remote", "qwen3_moe")
    config = json.loads((remote / "tokenizer_config.json").read_text())
    (remote / "tokenizer_config.json").write_text(json.dumps({**config, "auto_map": {"AutoTokenizer": "x.Y"}}))
    assert not _generic_backend(remote)


def test_a_trainers_tokenizer_imports_neither_autotokenizer_nor_torchdynamo(tmp_path):
    """What the direct path is for: ~1.7 s of CPU at every trainer start (rank 0) and evaluation."""
    path = tokenizer_dir(tmp_path, "qwen3_moe")
    script = ("import sys\nfrom gspo_mcore.data.tokenizer import load_tokenizer\n"
              f"tokenizer = load_tokenizer({str(path)!r})\n"
              "print(tokenizer.encode('name a fruit'), 'transformers.models.auto.tokenization_auto' in sys.modules, "
              "'torch._dynamo' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=environment(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["False", "False"], done.stdout
