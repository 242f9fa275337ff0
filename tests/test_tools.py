import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gspo_mcore.common.errors import InputError
from gspo_mcore.tools.runner import (QWEN3_TOOL_TEMPLATE, ToolCall, ToolCallError, ToolResult, ToolRunner,
                                      ToolStats, load_tools, parse_tool_calls, tool_messages)
from helpers import REPO, environment

F = "tests.tool_fixtures"
FIXTURE_TOOLS = [f"{F}:{name}" for name in ("lookup", "add", "explode", "sleep_forever", "huge", "record",
                                            "not_text", "chatty", "heavy_modules")]


def call_text(name, arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


# ------------------------------------------------------------------------------ loading
def test_schemas_come_from_type_hints_and_docstrings():
    tools = load_tools([f"{F}:lookup", f"{F}:add"])
    assert list(tools.functions) == ["lookup", "add"]
    assert tools.schemas[0] == {"type": "function", "function": {
        "name": "lookup", "description": "Look up which country a city is in.",
        "parameters": {"type": "object", "required": ["key"],
                       "properties": {"key": {"type": "string", "description": "The city, lower case."}}},
        "return": {"type": "string"}}}
    assert tools.schemas[1]["function"]["parameters"]["required"] == ["a"]  # b has a default


@pytest.mark.parametrize("names, message", [
    ([f"{F}:undocumented"], r"tool 'tests.tool_fixtures:undocumented': no JSON schema .*no docstring"),
    ([f"{F}:unhinted"], r"tool 'tests.tool_fixtures:unhinted': no JSON schema .*missing a type hint"),
    ([f"{F}:lookup", f"{F}:lookup"], r"tool 'tests.tool_fixtures:lookup': another tool is already named 'lookup'"),
    ([f"{F}:missing"], r"tool 'tests.tool_fixtures:missing': cannot import"),
    (["lookup"], r"^tool 'lookup': not 'module:function'$"),
])
def test_bad_tools_are_one_line_errors(names, message):
    with pytest.raises(InputError, match=message) as err:
        load_tools(names)
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------------------ parsing
@pytest.fixture(scope="module")
def tools():
    return load_tools([f"{F}:lookup", f"{F}:add"])


def test_parse_several_calls_in_one_turn(tools):
    text = ("<think>\nneed two facts\n</think>\n\n" + call_text("lookup", {"key": "paris"}) + "\n"
            + call_text("add", {"a": 1, "b": 2}))
    assert parse_tool_calls(text, tools) == [ToolCall("lookup", {"key": "paris"}), ToolCall("add", {"a": 1, "b": 2})]
    assert parse_tool_calls("Paris is in France.", tools) == []


def test_arguments_as_a_json_string(tools):
    text = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 3}"}</tool_call>'
    assert parse_tool_calls(text, tools) == [ToolCall("add", {"a": 3})]


@pytest.mark.parametrize("text, expected", [
    ("<tool_call>\n{\"name\": \"lookup\", \"arguments\": {\"key\": \n</tool_call>",
     ToolCallError("", "error: tool call is not JSON (Expecting value: line 3 column 1 (char 42))")),
    ("<tool_call>" + "[" * 100_000 + "</tool_call>",
     ToolCallError("", "error: tool call is not JSON (maximum recursion depth exceeded while decoding a JSON array "
                       "from a unicode string)")),
    ('<tool_call>["lookup"]</tool_call>', ToolCallError("", 'error: a tool call is {"name": ..., "arguments": {...}}')),
    (call_text("foo", {}), ToolCallError("foo", "error: unknown tool 'foo'; available: lookup, add")),
    (call_text("lookup", {}), ToolCallError("lookup", "error: tool 'lookup': missing a required argument: 'key'")),
    (call_text("lookup", {"key": "a", "city": "b"}),
     ToolCallError("lookup", "error: tool 'lookup': got an unexpected keyword argument 'city'")),
    (call_text("lookup", ["paris"]), ToolCallError("lookup", "error: tool 'lookup': arguments must be a JSON object")),
    ('<tool_call>{"name": "add", "arguments": "a=1"}</tool_call>',
     ToolCallError("add", "error: tool 'add': arguments must be a JSON object")),
    ('<tool_call>\n{"name": "lookup", "arguments": {"key": "paris"}}',
     ToolCallError("", "error: <tool_call> without </tool_call>")),
])
def test_malformed_calls_are_messages_for_the_model(tools, text, expected):
    assert parse_tool_calls(text, tools) == [expected]


def test_a_bad_call_does_not_hide_a_good_one(tools):
    text = call_text("foo", {}) + call_text("lookup", {"key": "rome"})
    assert [type(c) for c in parse_tool_calls(text, tools)] == [ToolCallError, ToolCall]


# ------------------------------------------------------------------------------ running
@pytest.fixture(scope="module")
def runner():
    runner = ToolRunner(FIXTURE_TOOLS, workers=2, timeout_s=1.0, max_output_chars=100)
    yield runner
    runner.close()


def run_one(runner, tool, **arguments) -> ToolResult:
    return runner.run([ToolCall(tool, arguments)])[0]


def test_results_and_errors(runner):
    runner.take_stats()
    assert runner.run([ToolCall("lookup", {"key": "paris"}), ToolCall("add", {"a": 2, "b": 3})]) == [
        ToolResult("lookup", "France", "ok"), ToolResult("add", "5", "ok")]
    assert run_one(runner, "record", city="rome") == ToolResult(
        "record", '{"city": "rome", "country": "Italy", "known": true}', "ok")
    assert run_one(runner, "explode", reason="no such city") == ToolResult(
        "explode", "error: tool 'explode' raised ValueError: no such city", "error")
    assert run_one(runner, "not_text") == ToolResult(
        "not_text", "error: tool 'not_text' returned object, not text or JSON", "error")
    assert run_one(runner, "chatty", key="k") == ToolResult("chatty", "k", "ok")
    assert run_one(runner, "heavy_modules") == ToolResult("heavy_modules", "[]", "ok")  # workers import the tools only
    malformed = ToolCallError("foo", "error: unknown tool 'foo'; available: lookup")
    assert runner.run([malformed]) == [ToolResult("foo", malformed.message, "error")]
    long_name = parse_tool_calls(call_text("f" * 500, {}), runner.tools)[0]  # quoted in its message, then cut
    cut = len(long_name.message) - 100
    assert runner.run([long_name])[0].content == f"{long_name.message[:100]}...[truncated {cut} chars]"
    assert runner.take_stats() == ToolStats(calls=7, errors=2, timeouts=0, malformed=2)
    assert runner.take_stats() == ToolStats()


def test_huge_output_is_cut(runner):
    assert run_one(runner, "huge", size=100).content == "x" * 100
    assert run_one(runner, "huge", size=10_000_000) == ToolResult("huge", "x" * 100 + "...[truncated 9999900 chars]",
                                                                  "ok")
    assert run_one(runner, "explode", reason="y" * 500).content.endswith("...[truncated 441 chars]")


def test_a_hung_tool_times_out_and_its_worker_is_replaced(runner):
    runner.take_stats()
    pids = {w.process.pid for w in runner._live}
    started = time.monotonic()
    assert run_one(runner, "sleep_forever") == ToolResult(
        "sleep_forever", "error: tool 'sleep_forever' timed out after 1 s", "timeout")
    assert time.monotonic() - started < 3
    results = runner.run([ToolCall("lookup", {"key": "rome"})] * 4)  # both slots, the fresh one too
    assert results == [ToolResult("lookup", "Italy", "ok")] * 4
    assert len(runner._live) == 2 and len(pids & {w.process.pid for w in runner._live}) == 1
    assert runner.take_stats() == ToolStats(calls=5, timeouts=1)


def test_tool_workers_run_in_sessions_of_their_own(runner):
    """Out of reach of the terminal's Ctrl-C to the trainer's process group (the trainer stops them)."""
    import os

    assert runner._live and all(os.getsid(w.process.pid) == w.process.pid != os.getsid(0) for w in runner._live)


def test_a_worker_that_died_is_replaced(runner):
    for worker in list(runner._live):  # between calls (killed, out of memory)
        worker.process.kill()
        worker.process.wait()
    assert runner.run([ToolCall("lookup", {"key": "rome"})] * 3) == [ToolResult("lookup", "Italy", "ok")] * 3


def test_no_secrets_in_the_workers_environment(monkeypatch):
    for key, value in {"GSPO_ENGINE_API_KEY": "sk-1", "HF_TOKEN": "hf-1", "GSPO_TOOLS_TEST": "plain"}.items():
        monkeypatch.setenv(key, value)
    runner = ToolRunner([f"{F}:env_var"], workers=1)
    assert run_one(runner, "env_var", name="GSPO_ENGINE_API_KEY").content == "null"
    assert run_one(runner, "env_var", name="HF_TOKEN").content == "null"
    assert run_one(runner, "env_var", name="GSPO_TOOLS_TEST").content == "plain"
    runner.close()


def test_calls_from_many_threads(runner):
    runner.take_stats()
    cities = ["paris", "rome", "oslo"] * 8
    results = [None] * len(cities)

    def trajectory(i):
        results[i] = runner.run([ToolCall("lookup", {"key": cities[i]}), ToolCall("add", {"a": i})])

    threads = [threading.Thread(target=trajectory, args=(i,)) for i in range(len(cities))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    expected = {"paris": "France", "rome": "Italy", "oslo": "unknown"}
    assert results == [[ToolResult("lookup", expected[c], "ok"), ToolResult("add", str(i), "ok")]
                       for i, c in enumerate(cities)]
    assert runner.take_stats() == ToolStats(calls=2 * len(cities))


def test_a_worker_that_cannot_start_is_one_line():
    runner = ToolRunner([f"{F}:lookup"], workers=1)
    runner.tools = dataclasses.replace(runner.tools, names=("tests.no_such_module:f",))  # as if not importable there
    worker = next(iter(runner._live)).process
    worker.kill()
    worker.wait()
    for _ in range(2):  # the slot stays: the next call tries again rather than waiting forever
        with pytest.raises(InputError, match=r"^tools tests.no_such_module:f: a worker did not start \(.*No module"):
            run_one(runner, "lookup", key="paris")
    runner.close()


ORPHAN_MAIN = """
import threading
from gspo_mcore.tools.runner import ToolCall, ToolRunner

def hang(tool):
    worker = ToolRunner([f"tests.tool_fixtures:{tool}"], workers=1, timeout_s=600)._take()
    print(worker.process.pid, flush=True)
    worker.call(ToolCall(tool, {}), 600)

# Started by a rollout thread: the kernel's parent-death signal would follow the thread, not us.
threading.Thread(target=hang, args=("sleep_forever",), daemon=True).start()
hang("backtrack")  # stuck in C, where the worker's own watch for its parent never runs
"""


def test_no_worker_outlives_a_killed_trainer(tmp_path):
    script = tmp_path / "main.py"
    script.write_text(ORPHAN_MAIN)
    trainer = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=REPO,
                               env=environment(warnings=True))
    pids = [int(trainer.stdout.readline()), int(trainer.stdout.readline())]
    os.kill(trainer.pid, signal.SIGKILL)
    trainer.wait()
    deadline = time.monotonic() + 5
    try:
        while any(map(alive, pids)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(alive, pids))
    finally:
        for pid in filter(alive, pids):
            os.kill(pid, signal.SIGKILL)


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"  # nobody may reap an orphan here
    except FileNotFoundError:
        return False


# ------------------------------------------------------------------------------ rendering
def test_rendering_in_qwen3_format():
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")))
    tools = load_tools([f"{F}:lookup"])
    turn = call_text("lookup", {"key": "paris"}) + "\n" + call_text("lookup", {"key": "rome"})
    results = [ToolResult("lookup", "France", "ok"), ToolResult("lookup", "Italy", "ok")]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where are Paris and Rome?"},
                {"role": "assistant", "content": turn}, *tool_messages(results)]
    text = tokenizer.apply_chat_template(messages, tools=tools.schemas, chat_template=QWEN3_TOOL_TEMPLATE,
                                         tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user query."
        "\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + json.dumps(tools.schemas[0]) +
        "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
        "<args-json-object>}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\nWhere are Paris and Rome?<|im_end|>\n"
        "<|im_start|>assistant\n" + turn + "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nFrance\n</tool_response>\n<tool_response>\nItaly\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n")
    assert parse_tool_calls(text.split("<|im_start|>assistant\n")[1], tools) == [
        ToolCall("lookup", {"key": "paris"}), ToolCall("lookup", {"key": "rome"})]
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tokenizer.apply_chat_template(plain, chat_template=QWEN3_TOOL_TEMPLATE, tokenize=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")


def test_the_python_tool_runs_code_with_limits_and_no_environment(monkeypatch):
    from transformers.utils import get_json_schema

    from gspo_mcore.tools import python as tool

    assert get_json_schema(tool.python)["function"]["parameters"]["required"] == ["code"]
    assert tool.python("print(sum(range(10)))") == "45"
    monkeypatch.setenv("GSPO_ENGINE_API_KEY", "s3cret")
    from gspo_mcore.sandbox.launch import THREAD_ENV  # one thread for numpy's BLAS

    assert set(eval(tool.python("import os; print(sorted(os.environ))"))) <= {"LC_CTYPE", "PWD", *THREAD_ENV}
    assert "ZeroDivisionError" in tool.python("1/0")
    assert tool.python("x = 1") == "(no output: use print())"
    assert tool.python("print('a' * 10000)").endswith("...[truncated 6000 chars]")
    monkeypatch.setattr(tool, "MEMORY_BYTES", 512 * 1024**2)
    assert "MemoryError" in tool.python("x = bytearray(1024**3)")
    monkeypatch.setattr(tool, "CPU_SECONDS", 1)
    assert "killed by signal" in tool.python("while True: pass")


def test_the_python_tool_runs_in_the_sandbox(tmp_path):
    from gspo_mcore.tools import python as tool

    secret = tmp_path / "key"
    secret.write_text("s3cret")
    assert "FileNotFoundError" in tool.python(f"print(open({str(secret)!r}).read())")  # the host's files
    assert "PermissionError" in tool.python("import socket; socket.create_connection(('1.1.1.1', 80))")
    assert tool.python("import os; print(os.getuid() != 0)") == "True"


def test_a_close_while_a_thread_calls_a_tool_ends_the_call_and_no_worker_starts_after():
    """The run closes its tools while a group thread is inside a call (an asynchronous producer does
    not wait for its threads): the call ends in an error result, and a later call is refused; it
    was given a fresh worker that nothing would ever stop."""
    runner = ToolRunner([f"{F}:sleep_forever", f"{F}:lookup"], workers=1, timeout_s=30)
    [worker] = [w.process for w in runner._live]
    results = []
    thread = threading.Thread(target=lambda: results.append(run_one(runner, "sleep_forever")))
    thread.start()
    time.sleep(0.5)  # the call is in the worker
    runner.close()
    thread.join(30)
    assert not thread.is_alive() and worker.poll() is not None
    assert [r.status for r in results] == ["error"], results
    with pytest.raises(RuntimeError, match="called after their runner was closed"):
        run_one(runner, "lookup", key="paris")
    assert runner._live == set()
