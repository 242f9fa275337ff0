"""Prompt datasets from JSONL or Parquet: each record a prompt (a string, or a chat as a list of
{role, content}) or chat `messages`, plus the reference answer the reward checks; any other
field is kept for rewards that ask for it (docs/05-data-and-rewards.md).

Other frameworks' datasets load as they are: verl's (`prompt` a chat, the answer in
`reward_model.ground_truth`) and slime's (`--label-key label`). A key may be a dotted path into
nested objects (`data.answer_key=reward_model.ground_truth`). An answer that is an object or a
list (verl's code ground truth as a Parquet struct) reaches the reward as JSON text."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from gspo_mcore.common.errors import InputError
from gspo_mcore.common.records import read_records, require_file


@dataclass(frozen=True)
class PromptSample:
    messages: list[dict]
    answer: str
    metadata: dict = field(default_factory=dict)  # the record's other fields
    where: str = field(default="", compare=False)  # its file and line (or row), for one-line errors

    @property
    def prompt(self) -> str:
        """The question: a prompt record's prompt, a chat record's last user message."""
        users = [m["content"] for m in self.messages if m["role"] == "user"]
        return str(users[-1]) if users else ""

    def reward_context(self) -> dict:
        """What a reward may ask for (gspo_mcore.rewards.CONTEXT)."""
        return {"prompt": self.prompt, "messages": self.messages, "extra": self.metadata}


# Where the answer is when data.answer_key is left at its default: ours, verl's, slime's (--label-key label).
DEFAULT_ANSWER_KEYS = ("answer", "reward_model.ground_truth", "label")
_MISSING = object()


def field_at(record: dict, key: str):
    """`record[key]`, or for a dotted key the nested value (`reward_model.ground_truth`); _MISSING if absent.
    A top-level field whose own name holds the dots comes first."""
    if key in record:
        return record[key]
    value = record
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def is_chat(value) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in value)


class PromptDataset:
    def __init__(self, samples: list[PromptSample]):
        self.samples = samples

    @classmethod
    def load(cls, path, prompt_key: str = "prompt", messages_key: str = "messages",
             answer_key: str = "answer") -> "PromptDataset":
        path = require_file(path)
        samples = []
        answer_keys = DEFAULT_ANSWER_KEYS if answer_key == DEFAULT_ANSWER_KEYS[0] else (answer_key,)
        for where, record in read_records(path):
            if not isinstance(record, dict):
                raise InputError(f"{where}: expected an object")
            messages, prompt = field_at(record, messages_key), field_at(record, prompt_key)
            if messages is not _MISSING:
                if not is_chat(messages):
                    raise InputError(f"{where}: field '{messages_key}' must be a list of {{role, content}}")
                used = messages_key
            elif isinstance(prompt, list):  # verl's and slime's chat prompts
                if not is_chat(prompt):
                    raise InputError(f"{where}: field '{prompt_key}' must be a string or a list of {{role, content}}")
                messages, used = prompt, prompt_key
            elif prompt is not _MISSING:
                messages, used = [{"role": "user", "content": str(prompt)}], prompt_key
            else:
                raise InputError(f"{where}: missing field '{prompt_key}' (or '{messages_key}')")
            key = next((k for k in answer_keys if field_at(record, k) is not _MISSING), None)
            if key is None:
                also = (" (nor verl's 'reward_model.ground_truth' nor slime's 'label'; data.answer_key names another)"
                        if len(answer_keys) > 1 else "")
                raise InputError(f"{where}: missing field '{answer_key}'{also}")
            metadata = {k: v for k, v in record.items() if k not in (used, key)}
            answer = field_at(record, key)
            # An object or list as JSON (str() would give Python's repr, which no reward parses).
            answer = json.dumps(answer, default=str) if isinstance(answer, (dict, list)) else str(answer)
            samples.append(PromptSample(messages, answer, metadata, where))
        if not samples:
            raise InputError(f"{path}: no samples")
        return cls(samples)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> PromptSample:
        return self.samples[index]


def chat_prompt_ids(tokenizer, messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
    """Token ids of the chat template with the assistant turn opened (generation prompt);
    `template_kwargs`: the template's own variables (data.chat_template_kwargs)."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **(template_kwargs or {}))
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # some tokenizers return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def prepare_command(prepare, description: str, input_help: str, prog: str | None = None, options=(),
                    argv: list[str] | None = None) -> int:
    """The `python -m gspo_mcore.data.prepare_*` command line: --input rows, --output prompt
    records, `prepare(input, output, **options)` -> how many it wrote (data.prepare_math,
    data.prepare_code). `description`: shown as written (the module's docstring: what it writes);
    `options`: (flag, argparse keywords) pairs whose values reach `prepare` by their dest."""
    import argparse

    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help=input_help)
    parser.add_argument("--output", required=True, help=".jsonl to write")
    for flag, keywords in options:
        parser.add_argument(flag, **keywords)
    args = vars(parser.parse_args(argv))
    source, output = args.pop("input"), args.pop("output")
    if not Path(source).is_file():
        raise InputError(f"{source}: input file not found")
    print(f"wrote {prepare(source, output, **args)} prompts to {output}")
    return 0
