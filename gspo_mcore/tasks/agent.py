"""The CPU agent task (configs/agent_cpu.yaml): look a key up in a table drawn per prompt, with a tool.

    system: tools lookup ( table key ) <eos> user: look up "k_3" in "t_12" <eos> assistant:
    <tool_call> { "name" : "lookup" , "arguments" : { "table" : "t_12" , "key" : "k_3" } } </tool_call> <eos>
    user: <tool_response> v_17 </tool_response> <eos> assistant: v_17 <eos>

The value of a (table, key) pair is drawn from a hash (`lookup`), so a prompt's answer cannot be
known without calling the tool: a guess is right 1 time in VALUES (32). The reward is 1 when the
first word of the last turn is the value. The tokenizer is word-level (toy.make_tokenizer,
256 words) and its vocabulary has the tool tokens and the JSON pieces as words: JSON allows
whitespace between tokens, so the call above, decoded with single spaces, is Qwen3's format and
parses exactly. Keys and tables are quoted words, in the prompt as in the call: the argument
the model writes is the very token it must copy. Its chat template is Qwen3's, word by word,
but for a tool's error (a malformed call's or a failed tool's message, words the vocabulary does
not have): it renders as the word `error`, so a sample shows `<tool_response> error
</tool_response>` where it showed an empty response.

**A warm start, not a model that knows nothing.** A random tiny model never writes a 19-token
call by chance; a user's pretrained instruct model knows the tool format already. So the writer
fits the random tiny Qwen3-MoE briefly (supervised, plain transformers on CPU, WARM_STEPS steps,
seeded, one thread; ~25 s on an idle core) on transcripts of the FORMAT: the call names the
prompt's table, but its key is drawn at random among KEYS (8) in all but KEY_HINT (20%) of them,
where it is the prompt's key (a weak prior, as a pretrained model's); the tool's true result for
that key; the answer relaying the result. The warm model calls the tool in format and relays what
it returns, but asks the wrong key most of the time: its reward starts near 0.3. RL has to learn
to ask for the key the prompt names (configs/agent_cpu.yaml's rise, and what a weaker prior or no
LR warmup does: docs/03-multi-turn.md, made by bench/doc_figures.py agent and agent_ablations).

`python -m gspo_mcore.tasks.agent OUT_DIR` writes OUT_DIR/model (the warm model + tokenizer),
OUT_DIR/prompts.jsonl and OUT_DIR/eval.jsonl, to a temporary sibling first; the same seed gives
the same files.
"""

from __future__ import annotations

import hashlib
import json
import random
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from gspo_mcore.tasks import toy
from gspo_mcore.rollout.engine_handle import environment_ids

if TYPE_CHECKING:
    import torch  # the writer's functions import it: a reward or tool worker needs neither it nor transformers

TABLES = 64
KEYS = 8
VALUES = 32
WARM_STEPS = 300
KEY_HINT = 0.2  # the fraction of format transcripts whose call asks the prompt's key
WARM_BATCH = 32
WARM_LR = 3e-3
WARM_THREADS = 1
SPECIALS = ("<pad>", "<eos>", "<unk>", "system:", "user:", "assistant:", "tools", "(", ")", "look", "up", "in")
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
JSON_WORDS = ("{", "}", ":", ",", '"name"', '"arguments"', '"lookup"', '"table"', '"key"', "lookup", "table", "key")
# Qwen3's tool format (gspo_mcore.tools.runner.QWEN3_TOOL_TEMPLATE) word by word: the tools in
# a system turn (name and argument names: the vocabulary has no room for the JSON schema's prose),
# every turn ended by <eos> (Qwen3's <|im_end|>), an assistant turn as written, consecutive tool
# results in one user turn, each in <tool_response>.
CHAT_TEMPLATE = (
    "{%- if tools %}system: tools {% for tool in tools %}{{ tool.function.name }} ( "
    "{{ tool.function.parameters.properties.keys() | join(' ') }} ) {% endfor %}<eos> {% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}user: {% endif %}"
    "<tool_response> {{ 'error' if m.content.startswith('error') else m.content }} </tool_response> "
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %} <eos> {% endif %}"
    "{%- else %}{{ m.role }}: {{ m.content }} <eos> {% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}assistant:{% endif %}"
)


def vocabulary() -> list[str]:
    words = [*SPECIALS, *TOOL_TOKENS, *JSON_WORDS]
    words += [f'"t_{i}"' for i in range(TABLES)] + [f'"k_{i}"' for i in range(KEYS)]
    words += [f"v_{i}" for i in range(VALUES)]
    words += ["error"]  # a failed or malformed call's result (the chat template's rendering of it)
    words += [f"<unused_{i}>" for i in range(256 - len(words))]
    assert len(words) == 256
    return words


def lookup(table: str, key: str) -> str:
    """Look a key up in a table.

    Args:
        table: The table's name, e.g. t_12.
        key: The key to look up in it, e.g. k_3.
    """
    digest = hashlib.sha256(f"{table}/{key}".encode()).digest()
    return f"v_{int.from_bytes(digest[:8], 'little') % VALUES}"


def lookup_reward(response: str, answer: str) -> float:
    """1.0 if the first word of the response (the last turn) is the value `answer`."""
    words = response.split()
    return 1.0 if words and words[0] == answer else 0.0


def tool_call(table: str, key: str) -> str:
    """A call of `lookup` as the model writes it: Qwen3's format, one word per JSON token."""
    return (f'<tool_call> {{ "name" : "lookup" , "arguments" : {{ "table" : "{table}" , "key" : "{key}" }} }} '
            "</tool_call>")


def prompt_text(table: str, key: str) -> str:
    return f'look up "{key}" in "{table}"'


def _draw(rng: random.Random) -> tuple[str, str]:
    return f"t_{rng.randrange(TABLES)}", f"k_{rng.randrange(KEYS)}"


def make_prompts(path: Path, count: int, seed: int) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(count):
            table, key = _draw(rng)
            f.write(json.dumps({"prompt": prompt_text(table, key), "answer": lookup(table, key)}) + "\n")


def warm_transcripts(tokenizer, count: int, rng: random.Random,
                     key_hint: float = KEY_HINT) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids, loss mask) of `count` transcripts of the format, laid out by tokens as the tool
    loop lays out a trajectory (prompt, call, the tool's result spliced by `environment_ids`,
    answer): the call names the prompt's table and a random key (the prompt's own in a share
    `key_hint` of them); the answer relays the result."""
    import torch
    from transformers.utils import get_json_schema

    tools = [get_json_schema(lookup)]
    eos = tokenizer.eos_token_id
    sequences, masks = [], []
    for _ in range(count):
        table, key = _draw(rng)
        asked = key if rng.random() < key_hint else f"k_{rng.randrange(KEYS)}"  # mostly not the prompt's
        value = lookup(table, asked)
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt_text(table, key)}],
                                               tools=tools, add_generation_prompt=True, tokenize=False)
        prompt = tokenizer.encode(prompt, add_special_tokens=False)
        call = tokenizer.encode(tool_call(table, asked), add_special_tokens=False) + [eos]
        result = environment_ids(tokenizer, [{"role": "tool", "name": "lookup", "content": value}], call)
        answer = tokenizer.encode(value, add_special_tokens=False) + [eos]
        sequences.append(prompt + call + result + answer)
        masks.append([0] * len(prompt) + [1] * len(call) + [0] * len(result) + [1] * len(answer))
    return torch.tensor(sequences), torch.tensor(masks, dtype=torch.float32)


def warm_start(model_dir: Path, seed: int, steps: int = WARM_STEPS, key_hint: float = KEY_HINT) -> None:
    """Fit the model of `model_dir` on `steps` batches of format transcripts, in place."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy: the writer only

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=WARM_LR, weight_decay=0.0)
    rng = random.Random(seed + 1)
    model.train()
    # The same numerics wherever it runs (OMP_NUM_THREADS, a caller's torch.set_num_threads):
    # the thread count changes the reductions, so the model measured is the one fitted on
    # WARM_THREADS. One thread: two spun against a loaded machine's other work (under the test
    # suite the warm start took 287 s with two, against ~25 s idle).
    threads = torch.get_num_threads()
    torch.set_num_threads(WARM_THREADS)
    try:
        for _ in range(steps):
            ids, mask = warm_transcripts(tokenizer, WARM_BATCH, rng, key_hint)
            logits = model(input_ids=ids[:, :-1]).logits
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
            loss = (nll * mask[:, 1:]).sum() / mask[:, 1:].sum()  # position t predicts token t + 1
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(model_dir)


def make_model(model_dir: Path, seed: int, key_hint: float = KEY_HINT) -> None:
    """The toy's random tiny model with this task's tokenizer, warm-started on the format."""
    toy.make_model(model_dir, seed, vocabulary(), CHAT_TEMPLATE)
    warm_start(model_dir, seed, WARM_STEPS, key_hint)


def make_agent_task(out_dir, seed: int = 0, num_prompts: int = 1024, key_hint: float = KEY_HINT) -> Path:
    """The task; `key_hint` other than KEY_HINT: a warm start with a weaker or stronger prior (the
    ablation of docs/03, bench/doc_figures.py agent_ablations)."""
    return toy.make_toy_task(out_dir, seed, num_prompts, write_prompts=make_prompts,
                             write_model=partial(make_model, key_hint=key_hint))


if __name__ == "__main__":
    toy.writer_cli("gspo_mcore.tasks.agent", make_agent_task)
