"""The built-in tool loop (`rollout.function: tool_loop`): the model may call the functions of
`rollout.tools` in Qwen3's format (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
their JSON schemas given to the chat template as `tools=`); each call runs in a tool worker
(gspo_mcore.tools.runner) and its result, rendered by the chat template as a `tool` message,
is spliced in as environment tokens. Up to `rollout.max_turns` model turns, at most
`rollout.max_trajectory_tokens` after the prompt (then the trajectory ends "length"). A tool
that fails or a malformed call becomes an error message the model reads, never a crash.
"""

from __future__ import annotations

import asyncio

from gspo_mcore.rollout.engine_handle import EngineHandle, Task
from gspo_mcore.tools.runner import ToolCall, parse_tool_calls, tool_messages
from gspo_mcore.batch.trajectory import Trajectory


async def tool_loop(task: Task, engine: EngineHandle) -> Trajectory:
    config = engine.config
    prompt = engine.chat_ids(task.messages, tools=engine.tools.tools.schemas)
    trajectory = Trajectory(prompt_ids=prompt)
    # tool_runs / tool_failures: the calls a worker ran, and what those that raised or crashed
    # said (a tool failing on every call stops the run: RolloutSource.step_metrics).
    info = {"tool_calls": 0, "tool_errors": 0, "tool_timeouts": 0, "tool_runs": 0, "tool_failures": []}
    text = ""
    for _ in range(config.max_turns):
        left = config.max_trajectory_tokens - len(trajectory.token_ids)
        reply = await engine.generate(prompt + trajectory.token_ids, max_new_tokens=min(config.max_new_tokens, left))
        trajectory.add_model(reply)
        text = engine.tokenizer.decode(reply.response_ids, skip_special_tokens=True)
        calls = parse_tool_calls(text, engine.tools.tools)
        if not calls or reply.finish_reason == "length":
            break
        results = await asyncio.to_thread(engine.tools.run, calls)
        info["tool_calls"] += len(calls)
        info["tool_errors"] += sum(r.status == "error" for r in results)
        info["tool_timeouts"] += sum(r.status == "timeout" for r in results)
        ran = [(c, r) for c, r in zip(calls, results) if isinstance(c, ToolCall)]
        info["tool_runs"] += len(ran)
        info["tool_failures"] += [r.content for _, r in ran if r.status == "error"]
        environment = engine.environment_ids(tool_messages(results), reply.response_ids)
        if len(trajectory.token_ids) + len(environment) >= config.max_trajectory_tokens:
            trajectory.finish_reason = "length"  # no room left for the model to answer
            break
        trajectory.add_environment(environment)
    trajectory.text, trajectory.info = text, info
    return trajectory
