"""A CPU code task that learns: the toy model's world (configs/tiny_cpu.yaml's random tiny
Qwen3-MoE, a word-level vocabulary), whose answers are programs run in the real sandbox.

A prompt asks for an operation on two numbers read from stdin, showing one test's input:

    user: write max ( 3 5 ) assistant:

The vocabulary's program words are Python expressions in `a` and `b`, 55 for each of four
operations (`add`, `sub`, `mul`, `max`), all different text (`a+b`, `(b)+(a)`, `sum((a,b))`...).
The answer's first word becomes the program

    a, b = map(int, input().split())
    print(<word>)

which `program_rewards` hands, fenced, to the code reward (gspo_mcore.rewards.code): run in the
sandbox on the prompt's tests (the shown input and another), judged on the host. A word of
another operation prints wrong numbers, a word that is not an expression (`write`, `(`) fails
to run: an untrained model scores about 55/256 and must learn to read the request.

`python -m gspo_mcore.tasks.code OUT_DIR` writes OUT_DIR/model, OUT_DIR/prompts.jsonl and
OUT_DIR/eval.jsonl; the same seed gives the same files.
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

from gspo_mcore.rewards.code import answer_from_problem, code_group_reward
from gspo_mcore.rewards.code import reward_metrics, reward_options  # noqa: F401 (a reward worker's hooks)
from gspo_mcore.sandbox import Problem, Test
from gspo_mcore.tasks.toy import make_model, make_toy_task, writer_cli

OPERATIONS = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b, "max": max}
BASES = {"add": ("a+b", "b+a", "a-(-b)", "sum((a,b))", "-(-a-b)"),
         "sub": ("a-b", "-b+a", "a+(-b)", "-(b-a)", "~(b-a)+1"),
         "mul": ("a*b", "b*a", "(a*b)", "-a*-b", "a*b+0*a"),
         "max": ("max(a,b)", "max(b,a)", "(a)if(a>b)else(b)", "sorted((a,b))[1]", "max((a,b))")}
WRAPPERS = ("{}", "({})", "({})+0", "0+({})", "({})*1", "1*({})", "int({})", "({})-0", "+({})", "(({}))",
            "({})//1", "({})|0", "({})^0", "-(-({}))", "round({})", "int(+({}))", "({})+1-1", "-~({})-1",
            "~~({})", "({})*2//2")
WORDS_PER_OPERATION = 55
DIGITS = tuple(str(d) for d in range(10))
SPECIALS = ("<pad>", "<eos>", "<unk>", "user:", "assistant:", "write", "(", ")")
HEADER = "a, b = map(int, input().split())\n"
TESTS_PER_PROMPT = 2


def expressions(operation: str) -> list[str]:
    """WORDS_PER_OPERATION distinct expressions, each equal to the operation on every pair of
    digits (checked here, on trusted text of our own)."""
    words = []
    for wrapper, base in itertools.product(WRAPPERS, BASES[operation]):
        word = wrapper.format(base)
        pairs = itertools.product(range(10), repeat=2)
        if word not in words and all(eval(word, {}, {"a": a, "b": b}) == OPERATIONS[operation](a, b) for a, b in pairs):
            words.append(word)
    return words[:WORDS_PER_OPERATION]


def vocabulary() -> list[str]:
    words = [*SPECIALS, *OPERATIONS, *DIGITS]
    for operation in OPERATIONS:
        found = expressions(operation)
        assert len(found) == WORDS_PER_OPERATION, (operation, len(found))
        words += found
    words += [f"<unused_{i}>" for i in range(256 - len(words))]
    assert len(words) == 256 and len(set(words)) == 256
    return words


def program(response: str) -> str | None:
    """The program the response's first word makes, fenced as a model writes code; None when
    the response is empty."""
    words = response.split()
    return f"```python\n{HEADER}print({words[0]})\n```" if words else None


def program_rewards(responses: list[str], answers: list[str]) -> list[float]:
    """The code reward of each response's program on its prompt's tests (`answers`), a prompt's
    group in one sandbox (reward.batched: true)."""
    fenced = [program(response) or "" for response in responses]  # no words: no code block, 0
    return code_group_reward(fenced, answers)


program_rewards.runs_model_code = True  # the run's start-up checks the sandbox (gspo_mcore.run.start)


def make_prompts(path: Path, count: int, seed: int) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(count):
            operation = rng.choice(list(OPERATIONS))
            pairs = [(rng.randrange(10), rng.randrange(10)) for _ in range(TESTS_PER_PROMPT)]
            tests = tuple(Test(f"{a} {b}\n", f"{OPERATIONS[operation](a, b)}\n") for a, b in pairs)
            prompt = f"write {operation} ( {pairs[0][0]} {pairs[0][1]} )"
            f.write(json.dumps({"prompt": prompt, "answer": answer_from_problem(Problem("stdin", tests))}) + "\n")


def make_code_model(model_dir: Path, seed: int, **kwargs) -> None:
    make_model(model_dir, seed, words=vocabulary(), **kwargs)


def make_code_task(out_dir, seed: int = 0, num_prompts: int = 1024) -> Path:
    return make_toy_task(out_dir, seed, num_prompts, write_prompts=make_prompts, write_model=make_code_model)


if __name__ == "__main__":
    writer_cli("gspo_mcore.tasks.code", make_code_task)
