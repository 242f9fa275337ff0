"""Rollout functions: how one task (a prompt row) becomes trajectories, chosen by
`rollout.function` like the reward (a built-in name or `module:function`).

    async def my_rollout(task: Task, engine: EngineHandle) -> Trajectory | list[Trajectory]

`single_turn` (the default) is not a function here: the rollout source's own batched path,
unchanged. A function is called `train.group_size` times per prompt; every trajectory its calls
return joins that prompt's group. It works in token ids: `engine.generate(ids)` samples a model
turn and returns its tokens, per-token log-probs and weight versions (a Rollout), always on the
trajectory's own server (its prefix cache serves the next turn); `engine.chat_ids(messages)`
and `engine.environment_ids(messages)` render the chat template, so the model's tokens are
never re-tokenized (re-tokenizing a transcript shifts tokens against their log-probs).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from gspo_mcore.errors import InputError
from gspo_mcore.plugins import by_name
from gspo_mcore.rollout.response import Rollout
from gspo_mcore.rollout.trajectory import Trajectory

SINGLE_TURN = "single_turn"


@dataclass
class Task:
    """One prompt row: its chat `messages`, reference `answer`, the row's other fields (`extra`)."""
    messages: list[dict]
    answer: str
    extra: dict = field(default_factory=dict)


class EngineHandle:
    """What a rollout function gets for one trajectory (see the module docstring)."""

    def __init__(self, client, tokenizer, server: int, sampling: dict, seed: int, config=None,
                 weight_version: str | None = None, oldest_version: int | None = None, name: str = "", tools=None,
                 template_kwargs: dict | None = None):
        """`config`: the run's RolloutConfig (max_turns, max_trajectory_tokens, ... for functions
        that read them); `template_kwargs`: data.chat_template_kwargs, for every rendering."""
        self.client, self.tokenizer, self.server, self.sampling = client, tokenizer, server, sampling
        self.config, self.template_kwargs = config, dict(template_kwargs or {})
        self.seed, self.weight_version, self.oldest_version, self.name = seed, weight_version, oldest_version, name
        self.tools = tools  # gspo_mcore.rollout.tools.ToolRunner of rollout.tools (None without tools)
        self.calls = 0

    async def generate(self, input_ids: list[int], max_new_tokens: int | None = None) -> Rollout:
        """One model turn from `input_ids` (prompt + every token so far)."""
        params = dict(self.sampling, sampling_seed=self.seed + self.calls)
        if max_new_tokens is not None:
            params["max_new_tokens"] = max_new_tokens
        self.calls += 1
        return await asyncio.to_thread(self.client.generate_one, f"{self.name}/turn-{self.calls}", list(input_ids),
                                       params, self.server, self.weight_version, self.oldest_version)

    def chat_ids(self, messages: list[dict], **template_kwargs) -> list[int]:
        """The chat template's token ids for `messages`, the assistant turn opened (e.g.
        `tools=` the tools' JSON schemas)."""
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 **{**self.template_kwargs, **template_kwargs})
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def environment_ids(self, messages: list[dict], after: list[int]) -> list[int]:
        """The tokens the chat template puts after a model turn that ended with `after` (its
        tokens) for `messages` (tool results, a user's reply), through the next assistant
        turn's opening: the template's text for [a model turn, messages] past the model turn,
        less the end-of-turn marker when the model already wrote it."""
        return environment_ids(self.tokenizer, messages, after, **self.template_kwargs)


def environment_ids(tokenizer, messages: list[dict], after: list[int], **template_kwargs) -> list[int]:
    marker = "\u2063"  # an assistant turn whose content the template leaves as written
    base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": marker}]
    full = tokenizer.apply_chat_template(base + messages, tokenize=False, add_generation_prompt=True,
                                         **template_kwargs)
    if full.count(marker) != 1:
        raise InputError("rollout.function: the chat template does not render an assistant turn as written; "
                         "environment turns cannot be spliced in by tokens")
    text = full[full.index(marker) + len(marker):]
    eos = tokenizer.eos_token
    if eos and after and after[-1] == tokenizer.eos_token_id and text.lstrip(" ").startswith(eos):
        text = text.lstrip(" ")[len(eos):]  # the model wrote its end of turn itself
    return list(tokenizer.encode(text, add_special_tokens=False))


RolloutFunction = Callable[[Task, EngineHandle], Awaitable["Trajectory | list[Trajectory]"]]


def load_rollout_function(name: str) -> RolloutFunction | None:
    """None for the single-turn default (the source's own path)."""
    if name == SINGLE_TURN:
        return None
    from gspo_mcore.rollout.tool_loop import tool_loop

    return by_name(name, {"tool_loop": tool_loop}, "rollout.function")


def run_functions(function: RolloutFunction, tasks: list[Task], repeats: int, handle_for,
                  concurrency: int) -> list[list[Trajectory]]:
    """`function` on each task `repeats` times, at most `concurrency` trajectories at once:
    each task's trajectories, in order. `handle_for(task_index, repeat)` makes the handles."""
    async def one(semaphore, i, k):
        async with semaphore:
            out = await function(tasks[i], handle_for(i, k))
        return out if isinstance(out, list) else [out]

    async def all_of_them():
        # Each engine call waits in a thread (asyncio.to_thread): the default pool (min(32, cores
        # + 4) threads) would cap the requests in flight far below the servers' capacity.
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=max(1, concurrency)))
        semaphore = asyncio.Semaphore(max(1, concurrency))
        results = await asyncio.gather(*(one(semaphore, i, k) for i in range(len(tasks)) for k in range(repeats)))
        return [[t for k in range(repeats) for t in results[i * repeats + k]] for i in range(len(tasks))]

    return asyncio.run(all_of_them())
