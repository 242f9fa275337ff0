"""Prompt datasets from JSONL or Parquet: each record a prompt (string) or chat `messages`,
plus the reference `answer` the reward checks; any other field is kept for rewards that ask
for it (docs/05-data-and-rewards.md)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from gspo_mcore.errors import InputError


@dataclass(frozen=True)
class PromptSample:
    messages: list[dict]
    answer: str
    metadata: dict = field(default_factory=dict)  # the record's other fields

    @property
    def prompt(self) -> str:
        """The question: a prompt record's prompt, a chat record's last user message."""
        users = [m["content"] for m in self.messages if m["role"] == "user"]
        return str(users[-1]) if users else ""

    def reward_context(self) -> dict:
        """What a reward may ask for (gspo_mcore.rewards.CONTEXT)."""
        return {"prompt": self.prompt, "messages": self.messages, "extra": self.metadata}


def _records(path: Path):
    """(where, record) pairs; `where` names the file and line or row for error messages."""
    if path.suffix == ".jsonl":
        with open(path) as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield f"{path}:{number}", json.loads(line)
                    except json.JSONDecodeError as err:
                        raise InputError(f"{path}:{number}: not valid JSON ({err})") from None
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq  # heavy: Parquet datasets only

        for number, record in enumerate(pq.read_table(path).to_pylist()):
            yield f"{path} row {number}", record
    else:
        raise InputError(f"{path}: unsupported dataset format (expected .jsonl or .parquet)")


def require_file(path) -> Path:
    """`path` as a Path; InputError naming it if there is no such file."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: dataset file not found")
    return path


class PromptDataset:
    def __init__(self, samples: list[PromptSample]):
        self.samples = samples

    @classmethod
    def load(cls, path, prompt_key: str = "prompt", messages_key: str = "messages",
             answer_key: str = "answer") -> "PromptDataset":
        path = require_file(path)
        samples = []
        for where, record in _records(path):
            if not isinstance(record, dict):
                raise InputError(f"{where}: expected an object")
            if messages_key in record:
                messages = record[messages_key]
                if not (isinstance(messages, list) and all(isinstance(m, dict) and {"role", "content"} <= set(m)
                                                            for m in messages)):
                    raise InputError(f"{where}: field '{messages_key}' must be a list of {{role, content}}")
            elif prompt_key in record:
                messages = [{"role": "user", "content": str(record[prompt_key])}]
            else:
                raise InputError(f"{where}: missing field '{prompt_key}' (or '{messages_key}')")
            if answer_key not in record:
                raise InputError(f"{where}: missing field '{answer_key}'")
            metadata = {k: v for k, v in record.items() if k not in (prompt_key, messages_key, answer_key)}
            samples.append(PromptSample(messages, str(record[answer_key]), metadata))
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
