"""Tools for multi-turn rollouts: plain Python functions the model calls between its turns.

A tool is named `module:function` and written as Hugging Face users write them: type hints and
a Google-style docstring, from which `transformers.utils.get_json_schema` makes the JSON schema
the chat template shows the model (`apply_chat_template(..., tools=toolset.schemas)`).

One model turn -> `parse_tool_calls` (Qwen3's `<tool_call>{"name": ..., "arguments": {...}}
</tool_call>` blocks) -> `ToolRunner.run` (each call in a worker process, with a time limit) ->
`tool_messages` (role "tool" messages for the next `apply_chat_template`). Nothing the model or
a tool does raises here: a malformed call, a tool that raises, hangs, returns something that is
not text or too much of it, becomes an error message for the model and a count in `ToolStats`.

Workers (gspo_mcore/tools/worker.py) import only the tools' modules and run without the
environment variables named like secrets (`SECRET_MARKERS`: the engines' API key, HF/W&B tokens,
cloud credentials). That keeps keys out of the model's reach through a tool that echoes its
environment; it is not a sandbox (a tool still reads files and the network as the trainer can)."""

from __future__ import annotations

import inspect
import json
import os
import queue
import re
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from gspo_mcore.common.errors import InputError
from gspo_mcore.common.plugins import by_name
from gspo_mcore.common.processes import child_env, kill_worker, read_json_reply, start_worker
from gspo_mcore.rewards.runner import STARTUP_TIMEOUT_S
from gspo_mcore.tools.worker import clip

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
# A worker's environment drops every variable whose name contains one of these (any case).
SECRET_MARKERS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "CREDENTIAL", "AUTH")


# Qwen3's chat format for tool use, for a tokenizer whose own template knows no tools (a CPU
# task's): the schemas, one JSON line each, in the system turn; an assistant turn verbatim (the
# model's own `<tool_call>` text; no `tool_calls` field); consecutive tool results in one user
# turn, each in `<tool_response>`. Qwen3's own template renders the same text for one question and
# its tool turns (checked), but drops the thinking of turns before a later question: this keeps it,
# so every turn's text is a prefix of the next one's.
QWEN3_TOOL_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}"
    "{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}"
    "{%- for tool in tools %}{{- '\n' + tool | tojson }}{%- endfor %}"
    "{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\n' + message.content + '<|im_end|>\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class ToolSet:
    names: tuple[str, ...]  # as configured: `module:function`
    functions: dict[str, Callable]  # the name the model calls (the function's) -> function
    schemas: list[dict]  # for apply_chat_template(tools=...)


def load_tools(names: list[str]) -> ToolSet:
    """The tools `names` (`module:function`) with their JSON schemas; a one-line InputError naming
    a tool that cannot be imported, has no schema, or repeats another's name."""
    # transformers at call time: ~0.7 s of imports a trainer rank needs only where tools are used
    from transformers.utils import get_json_schema

    functions, schemas = {}, []
    for name in names:
        if ":" not in name:  # no built-in tools: say what a name is
            raise InputError(f"tool {name!r}: not 'module:function'")
        function = by_name(name, {}, "tool")
        try:
            schema = get_json_schema(function)
        except Exception as err:  # no docstring, an argument without a hint or a description, ...
            raise InputError(f"tool {name!r}: no JSON schema from its type hints and docstring "
                             f"({type(err).__name__}: {err})") from None
        called = schema["function"]["name"]
        if called in functions:
            raise InputError(f"tool {name!r}: another tool is already named {called!r}")
        functions[called] = function
        schemas.append(schema)
    return ToolSet(tuple(names), functions, schemas)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


@dataclass(frozen=True)
class ToolCallError:
    """A call the model wrote wrong: never run, `message` is the model's answer."""
    name: str  # the tool it named, or "" if that could not be read
    message: str


def parse_tool_calls(text: str, tools: ToolSet) -> list[ToolCall | ToolCallError]:
    """Every `<tool_call>` block of one model turn's decoded text, in order; a block that is not
    a call of one of `tools` with arguments its function accepts is a ToolCallError. No calls
    means the model answered."""
    calls = [_parse_call(body, tools) for body in TOOL_CALL.findall(text)]
    if "<tool_call>" in TOOL_CALL.sub("", text):
        calls.append(ToolCallError("", "error: <tool_call> without </tool_call>"))
    return calls


def _parse_call(body: str, tools: ToolSet) -> ToolCall | ToolCallError:
    try:
        call = json.loads(body)
    except (json.JSONDecodeError, RecursionError) as err:  # RecursionError: nested too deep
        return ToolCallError("", f"error: tool call is not JSON ({err})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCallError("", 'error: a tool call is {"name": ..., "arguments": {...}}')
    name, arguments = call["name"], call.get("arguments", {})
    if name not in tools.functions:
        return ToolCallError(name, f"error: unknown tool {name!r}; available: {', '.join(tools.functions)}")
    if isinstance(arguments, str):  # some models write the arguments object as a JSON string
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):
            pass
    if not isinstance(arguments, dict):
        return ToolCallError(name, f"error: tool {name!r}: arguments must be a JSON object")
    try:
        inspect.signature(tools.functions[name]).bind(**arguments)
    except TypeError as err:
        return ToolCallError(name, f"error: tool {name!r}: {err}")
    return ToolCall(name, arguments)


@dataclass(frozen=True)
class ToolResult:
    name: str
    content: str  # what the model reads
    status: str  # "ok" | "error" | "timeout"


def tool_messages(results: list[ToolResult]) -> list[dict]:
    """The results as chat messages for apply_chat_template (Qwen3 renders each in a
    `<tool_response>` block of one user turn)."""
    return [{"role": "tool", "name": r.name, "content": r.content} for r in results]


@dataclass
class ToolStats:
    calls: int = 0  # calls run in a worker
    errors: int = 0  # of those: raised, returned neither text nor JSON, or killed their worker
    timeouts: int = 0  # of those: ran past the time limit (their worker was replaced)
    malformed: int = 0  # calls the model wrote wrong, never run


def tool_env() -> dict:
    """Our environment for a worker: no launcher identity, nothing named like a secret."""
    return {key: value for key, value in child_env().items()
            if not any(marker in key.upper() for marker in SECRET_MARKERS)}


class _ToolWorker:
    """One worker process and its private request/reply pipe pair."""

    def __init__(self, tools: ToolSet, max_output_chars: int):
        # The repository and our sys.path, so the worker imports what we could (as reward workers).
        path = os.pathsep.join([str(Path.cwd()), *filter(None, sys.path)])
        self.process = start_worker([sys.executable, "-m", "gspo_mcore.tools.worker", str(max_output_chars),
                                     *tools.names], {**tool_env(), "PYTHONPATH": path})
        reply = self.read(STARTUP_TIMEOUT_S)
        if reply != "ready":
            self.kill()
            reason = reply["error"] if isinstance(reply, dict) else "no answer in time"
            raise InputError(f"tools {', '.join(tools.names)}: a worker did not start ({reason})")

    def call(self, call: ToolCall, timeout_s: float) -> dict | None:
        """The reply, or None: none within `timeout_s`, or the worker died."""
        try:
            self.process.stdin.write(json.dumps({"name": call.name, "arguments": call.arguments}) + "\n")
            self.process.stdin.flush()
            return self.read(timeout_s)
        except (OSError, ValueError):  # ValueError: its pipes were closed under it (the runner's close)
            return None

    def read(self, timeout_s: float):
        return read_json_reply(self.process, timeout_s)

    def kill(self) -> None:
        kill_worker(self.process)


class ToolRunner:
    """`run(calls) -> results` over `workers` processes, from any number of threads at once: a call
    waits for a free worker, then has `timeout_s` to answer. `take_stats()` per step."""

    def __init__(self, tools: list[str], workers: int = 2, timeout_s: float = 10.0, max_output_chars: int = 4000):
        self.tools = load_tools(tools)  # fail fast, in this process, on a bad tool
        self.timeout_s, self.max_output_chars = timeout_s, max_output_chars
        self.stats = ToolStats()
        self._lock = threading.Lock()  # guards stats and _live
        self._live: set[_ToolWorker] = set()
        self.closed = False  # no worker starts after close (a closing run's thread still calling)
        self._idle: queue.Queue[_ToolWorker | None] = queue.Queue()  # None: a slot to start a worker in
        for _ in range(workers):  # here, usually on the main thread, where the kernel ties them to us
            self._idle.put(self._start())

    def run(self, calls: list[ToolCall | ToolCallError]) -> list[ToolResult]:
        """One result per call, in order: a ToolCallError's message, or what the tool said."""
        return [self._run(call) for call in calls]

    def _run(self, call: ToolCall | ToolCallError) -> ToolResult:
        if isinstance(call, ToolCallError):
            self._count("malformed")
            return ToolResult(call.name, clip(call.message, self.max_output_chars), "error")  # it may quote the call
        worker = self._take()
        started = time.monotonic()
        reply = worker.call(call, self.timeout_s)
        if reply is None:  # it hangs or died: its slot gets a fresh worker when next taken
            self._retire(worker)
            if time.monotonic() - started >= self.timeout_s:
                self._count("calls", "timeouts")
                return ToolResult(call.name, f"error: tool {call.name!r} timed out after {self.timeout_s:g} s",
                                  "timeout")
            self._count("calls", "errors")
            return ToolResult(call.name, f"error: tool {call.name!r} crashed (its worker exited)", "error")
        self._idle.put(worker)
        if "content" in reply:
            self._count("calls")
            return ToolResult(call.name, reply["content"], "ok")
        self._count("calls", "errors")
        return ToolResult(call.name, reply["error"], "error")

    def _take(self) -> _ToolWorker:
        """A free worker; a fresh one in the slot of one that hung, died, or never started."""
        worker = self._idle.get()
        if worker is not None and worker.process.poll() is None:
            return worker
        if worker is not None:
            self._forget(worker)
        try:
            return self._start()
        except BaseException:
            self._idle.put(None)  # the slot stays, for the next call to try again
            raise

    def _start(self) -> _ToolWorker:
        if self.closed:  # before a process is started for nothing
            raise self._closed_error()
        worker = _ToolWorker(self.tools, self.max_output_chars)
        with self._lock:
            if self.closed:  # closed while it started: it would outlive the run
                worker.kill()
                raise self._closed_error()
            self._live.add(worker)
        return worker

    def _closed_error(self) -> RuntimeError:
        return RuntimeError(f"tools {', '.join(self.tools.names)}: called after their runner was closed")

    def _forget(self, worker: _ToolWorker) -> None:
        worker.kill()
        with self._lock:
            self._live.discard(worker)

    def _retire(self, worker: _ToolWorker) -> None:
        self._forget(worker)
        self._idle.put(None)

    def _count(self, *fields: str) -> None:
        with self._lock:
            for field in fields:
                setattr(self.stats, field, getattr(self.stats, field) + 1)

    def take_stats(self) -> ToolStats:
        """The counts since the last call (or the start), and zero from now on."""
        with self._lock:
            stats, self.stats = self.stats, ToolStats()
        return stats

    def close(self) -> None:
        """Kill the workers, also one a thread is calling (its call ends in an error); a later
        call is refused rather than given a new worker nothing would stop."""
        with self._lock:
            self.closed = True
            workers, self._live = list(self._live), set()
        for worker in workers:
            worker.kill()
