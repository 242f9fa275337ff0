"""The CPU default's toy task: "name a color / an animal / a fruit / a number".

A random tiny Qwen3-MoE can learn it in minutes, and the reward is exact. The vocabulary
(256 words, word-level tokenizer) has 4 categories of 60 made-up words (`animal_17`, ...).
A prompt asks for one category among a few distracting words from all of them:

    user: name an animal ( fruit_3 color_44 number_9 ) assistant:

The reward is 1 when the first word of the answer is from the asked category, else 0, so
an untrained model scores about 60/256 ~ 0.23 and must learn to read the request.

`python -m gspo_mcore.tasks.toy OUT_DIR` writes OUT_DIR/model (tiny model + tokenizer) and
OUT_DIR/prompts.jsonl; the same seed gives the same files.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from gspo_mcore.common.errors import InputError
from gspo_mcore.common.files import atomic_output

# torch, tokenizers and transformers are imported by the writer's functions only: a reward worker
# imports this module for `category_reward` (and the long, code and agent tasks import it), and
# started in 2 s of CPU with them at the top, 0.01 s without (measured).

# The CPU tasks the shipped configs train, by the directory those configs read them from
# (model/ and prompts.jsonl): a run that finds them missing is told the command that writes them.
TASK_WRITERS = {"outputs/demo/toy": "gspo_mcore.tasks.toy", "outputs/long_task": "gspo_mcore.tasks.long",
                "outputs/agent_task": "gspo_mcore.tasks.agent", "outputs/vllm_toy": "gspo_mcore.tasks.toy --head-dim 64",
                "outputs/code_task": "gspo_mcore.tasks.code"}
CATEGORIES = ("color", "animal", "fruit", "number")
EVAL_PROMPTS = 64
WORDS_PER_CATEGORY = 60
SPECIALS = ("<pad>", "<eos>", "<unk>", "user:", "assistant:", "name", "a", "an", "(", ")")
ARTICLE = {"color": "a", "animal": "an", "fruit": "a", "number": "a"}
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def vocabulary() -> list[str]:
    words = list(SPECIALS) + list(CATEGORIES)
    words += [f"{c}_{i}" for c in CATEGORIES for i in range(WORDS_PER_CATEGORY)]
    words += [f"<unused_{i}>" for i in range(256 - len(words))]
    assert len(words) == 256
    return words


def category_reward(response: str, answer: str) -> float:
    """1.0 if the response's first word belongs to category `answer`."""
    words = response.split()
    return 1.0 if words and words[0].startswith(f"{answer}_") else 0.0


def make_tokenizer(out_dir: Path, words: list[str] | None = None, chat_template: str = CHAT_TEMPLATE) -> None:
    """A word-level tokenizer of `words` (the toy's vocabulary by default; the first three are
    pad, eos and unk): text splits on whitespace, decoding joins tokens with single spaces."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate(words or vocabulary())}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>")
    fast.chat_template = chat_template
    fast.save_pretrained(out_dir)


def make_prompts(path: Path, count: int, seed: int) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(count):
            category = rng.choice(CATEGORIES)
            fillers = [f"{rng.choice(CATEGORIES)}_{rng.randrange(WORDS_PER_CATEGORY)}" for _ in range(3)]
            prompt = f"name {ARTICLE[category]} {category} ( {' '.join(fillers)} )"
            f.write(json.dumps({"prompt": prompt, "answer": category}) + "\n")


def make_model(model_dir: Path, seed: int, words: list[str] | None = None, chat_template: str = CHAT_TEMPLATE,
               head_dim: int | None = None) -> None:
    """A model directory: a random all-MoE tiny model and a word-level tokenizer (the toy's, or
    another task's `words` and `chat_template`). `head_dim`: other than the tiny model's 32 (vLLM's
    CPU attention needs 64)."""
    import torch

    from gspo_mcore.megatron.qwen3_moe.tiny import make_tiny_checkpoint

    # All-MoE: SGLang 0.5.23 serves Qwen3-MoE dense layers as MoE (see gspo_mcore.engines.sglang.server).
    make_tiny_checkpoint(model_dir, seed=seed, dtype=torch.float32, mlp_only_layers=[],
                         eos_token_id=1, pad_token_id=0, bos_token_id=None,
                         **({"head_dim": head_dim} if head_dim else {}))
    make_tokenizer(model_dir, words, chat_template)


def make_toy_task(out_dir, seed: int = 0, num_prompts: int = 1024, write_prompts=make_prompts,
                  write_model=make_model, head_dim: int | None = None) -> Path:
    """OUT_DIR/model (by `write_model(dir, seed)`: a random all-MoE tiny model + tokenizer, or
    another task's model) and OUT_DIR/prompts.jsonl (by `write_prompts(path, count, seed)`: this
    task's, or another task's), written to a temporary sibling first; an existing complete OUT_DIR
    is left as is. OUT_DIR/eval.jsonl: EVAL_PROMPTS held-out prompts (another seed) for the
    evaluation. `head_dim`: the model's, when not the tiny model's."""
    out_dir = Path(out_dir)
    if not (out_dir / "prompts.jsonl").is_file():
        with atomic_output(out_dir, directory=True) as tmp:
            write_model(tmp / "model", seed, **({"head_dim": head_dim} if head_dim else {}))
            write_prompts(tmp / "prompts.jsonl", num_prompts, seed)
    if not (out_dir / "eval.jsonl").is_file():  # held out: another seed's prompts (eval.datasets)
        with atomic_output(out_dir / "eval.jsonl") as tmp:
            write_prompts(tmp, EVAL_PROMPTS, seed + 10_000)
    return out_dir


def check_task_written(config) -> None:
    """model.hf_dir or data.path missing where a CPU task of TASK_WRITERS belongs: one line
    naming the command that writes it (other missing inputs are named where they are read)."""
    for name, path in (("model.hf_dir", config.model.hf_dir), ("data.path", config.data.path)):
        if path and not Path(path).exists() and Path(path).parent.as_posix() in TASK_WRITERS:
            directory = Path(path).parent.as_posix()
            raise InputError(f"{name}: {path} not found; write the task first: "
                             f"python -m {TASK_WRITERS[directory]} {directory}")


def writer_cli(module: str, make, argv=None, head_dim: bool = False) -> None:
    """`python -m MODULE [--head-dim N] OUT_DIR`: a task writer's command line (its module
    docstring's first line is its help); prints the directory written. `head_dim`: the writer
    takes --head-dim."""
    doc = (sys.modules[make.__module__].__doc__ or "").strip().splitlines()
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=doc[0] if doc else None)
    parser.add_argument("out_dir", metavar="OUT_DIR", help="where to write the task (model/, prompts.jsonl, eval.jsonl)")
    if head_dim:
        parser.add_argument("--head-dim", type=int, default=None,
                            help="the model's attention head size (default 32; vLLM on CPU needs 64: "
                                 "configs/tiny_cpu_vllm.yaml's task is written with --head-dim 64)")
    args = parser.parse_args(argv)
    print(make(args.out_dir, **({"head_dim": args.head_dim} if head_dim and args.head_dim else {})))


if __name__ == "__main__":
    writer_cli("gspo_mcore.tasks.toy", make_toy_task, head_dim=True)
