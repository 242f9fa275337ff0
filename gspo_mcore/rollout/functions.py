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
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Awaitable, Callable

from gspo_mcore.common.errors import EngineError, InputError
from gspo_mcore.common.plugins import by_name
from gspo_mcore.rollout.engine_handle import EngineHandle, Task
from gspo_mcore.rollout.tool_loop import tool_loop
from gspo_mcore.batch.trajectory import Trajectory

SINGLE_TURN = "single_turn"


RolloutFunction = Callable[[Task, EngineHandle], Awaitable["Trajectory | list[Trajectory]"]]


def load_rollout_function(name: str) -> RolloutFunction | None:
    """None for the single-turn default (the source's own path)."""
    if name == SINGLE_TURN:
        return None
    return by_name(name, {"tool_loop": tool_loop}, "rollout.function")


def _name(function) -> str:
    return f"{getattr(function, '__module__', '?')}:{getattr(function, '__qualname__', function)}"


def run_functions(function: RolloutFunction, tasks: list[Task], repeats: int, handle_for,
                  concurrency: int) -> list[list[Trajectory]]:
    """`function` on each task `repeats` times, at most `concurrency` trajectories at once:
    each task's trajectories, in order. `handle_for(task_index, repeat)` makes the handles."""
    async def one(semaphore, i, k):
        async with semaphore:
            try:
                out = await function(tasks[i], handle_for(i, k))
            except (InputError, EngineError):  # already says whose it is
                raise
            except Exception as err:  # the user's function failed: their error, not the run's (exit 2)
                where = traceback.extract_tb(err.__traceback__)[-1]
                raise InputError(f"rollout.function {_name(function)}: raised {type(err).__name__}: {err} "
                                 f"(at {where.filename}:{where.lineno}; task {i}, call {k})") from None
        return out if isinstance(out, list) else [out]

    async def all_of_them():
        # Engine calls wait on the client's own event loop; tool calls in a thread (asyncio.to_thread):
        # the default pool (min(32, cores + 4) threads) would cap them below the trajectories running.
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=max(1, concurrency)))
        semaphore = asyncio.Semaphore(max(1, concurrency))
        results = await asyncio.gather(*(one(semaphore, i, k) for i in range(len(tasks)) for k in range(repeats)))
        return [[t for k in range(repeats) for t in results[i * repeats + k]] for i in range(len(tasks))]

    return asyncio.run(all_of_them())
