"""The agent task (gspo_mcore/tasks/agent.py): a call in its word-level vocabulary is Qwen3's
format and parses exactly, the tool's results splice in as its chat template renders them, the
lookup is deterministic, the reward reads the last turn, and the writer is deterministic and
leaves no half-written task. No servers."""

import asyncio
import json
from types import SimpleNamespace

import pytest

from gspo_mcore.tasks import agent as agent_task
from gspo_mcore.tasks.agent import lookup, lookup_reward, make_agent_task, tool_call
from gspo_mcore.tools.runner import ToolCall, load_tools, parse_tool_calls
from helpers import ScriptedClient

TOOLS = ["gspo_mcore.tasks.agent:lookup"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer  # here, not at collection: ~2.5 s of imports in every worker

    path = tmp_path_factory.mktemp("agent_tokenizer")
    agent_task.toy.make_tokenizer(path, agent_task.vocabulary(), agent_task.CHAT_TEMPLATE)
    return AutoTokenizer.from_pretrained(path)


def test_a_call_is_one_word_per_json_token_and_parses_exactly(tokenizer):
    ids = tokenizer.encode(tool_call("t_12", "k_3"), add_special_tokens=False) + [tokenizer.eos_token_id]
    assert tokenizer.unk_token_id not in ids and len(ids) == 20
    # What the tool loop parses: the model turn's tokens decoded without specials.
    text = tokenizer.decode(ids, skip_special_tokens=True)
    assert parse_tool_calls(text, load_tools(TOOLS)) == [ToolCall("lookup", {"table": "t_12", "key": "k_3"})]
    # The prompt names the key and the table by the very tokens the call carries.
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": 'look up "k_3" in "t_12"'}],
                                           tools=load_tools(TOOLS).schemas, add_generation_prompt=True, tokenize=False)
    assert prompt == 'system: tools lookup ( table key ) <eos> user: look up "k_3" in "t_12" <eos> assistant:'
    assert {'"k_3"', '"t_12"'} <= set(tokenizer.tokenize(prompt)) & set(tokenizer.convert_ids_to_tokens(ids))


def test_lookup_is_a_deterministic_table_per_prompt():
    assert lookup("t_12", "k_3") == lookup("t_12", "k_3")
    values = {lookup(f"t_{t}", f"k_{k}") for t in range(agent_task.TABLES) for k in range(agent_task.KEYS)}
    assert values <= {f"v_{i}" for i in range(agent_task.VALUES)} and len(values) == agent_task.VALUES
    # The same key means different values in different tables: the table cannot be ignored.
    assert len({lookup(f"t_{t}", "k_0") for t in range(agent_task.TABLES)}) > agent_task.VALUES // 2
    assert lookup("anything", "else").startswith("v_")  # a wrong argument is answered, never an error


@pytest.mark.parametrize("response, expected", [
    ("v_7", 1.0), ("v_7 v_3", 1.0), ("v_3 v_7", 0.0), ("", 0.0),
    (tool_call("t_1", "k_0"), 0.0),  # the last turn is another call: no answer
])
def test_reward_is_one_when_the_last_turns_first_word_is_the_value(response, expected):
    assert lookup_reward(response, "v_7") == expected


def test_the_tool_loop_splices_the_result_as_the_template_renders_the_whole_conversation(tokenizer):
    from gspo_mcore.rollout.engine_handle import EngineHandle, Task
    from gspo_mcore.rollout.tool_loop import tool_loop
    from gspo_mcore.tools.runner import ToolRunner

    value = lookup("t_12", "k_3")
    model = ScriptedClient.replying(tokenizer, [tool_call("t_12", "k_3"), value])
    runner = ToolRunner(TOOLS, workers=1, timeout_s=30)
    try:
        engine = EngineHandle(model, tokenizer, 0, {"temperature": 1.0}, seed=0, tools=runner,
                              config=SimpleNamespace(max_turns=2, max_trajectory_tokens=64, max_new_tokens=24))
        task = Task([{"role": "user", "content": 'look up "k_3" in "t_12"'}], value)
        trajectory = asyncio.run(tool_loop(task, engine))
    finally:
        runner.close()
    assert [s.trainable for s in trajectory.segments] == [True, False, True]
    assert lookup_reward(trajectory.text, task.answer) == 1.0
    assert tokenizer.convert_ids_to_tokens(trajectory.segments[1].token_ids) == [
        "user:", "<tool_response>", value, "</tool_response>", "<eos>", "assistant:"]
    whole = tokenizer.apply_chat_template(
        [*task.messages, {"role": "assistant", "content": tool_call("t_12", "k_3")},
         {"role": "tool", "name": "lookup", "content": value}, {"role": "assistant", "content": value}],
        tools=runner.tools.schemas, tokenize=False)
    assert trajectory.prompt_ids + trajectory.token_ids == tokenizer.encode(whole, add_special_tokens=False)


def test_a_malformed_call_shows_as_an_error_not_an_empty_response(tokenizer):
    """The tool loop's message for a malformed call is English the toy vocabulary cannot spell;
    it rendered as `<tool_response> </tool_response>` (every word unknown, dropped on decoding)."""
    from gspo_mcore.rollout.engine_handle import EngineHandle, Task
    from gspo_mcore.rollout.tool_loop import tool_loop
    from gspo_mcore.tools.runner import ToolRunner

    malformed = '<tool_call> { "name" : "lookup" , "arguments" : { "table" : "t_12" } } </tool_call>'  # no key
    model = ScriptedClient.replying(tokenizer, [malformed, "v_1"])
    runner = ToolRunner(TOOLS, workers=1, timeout_s=30)
    try:
        engine = EngineHandle(model, tokenizer, 0, {"temperature": 1.0}, seed=0, tools=runner,
                              config=SimpleNamespace(max_turns=2, max_trajectory_tokens=64, max_new_tokens=24))
        trajectory = asyncio.run(tool_loop(Task([{"role": "user", "content": 'look up "k_3" in "t_12"'}], "v_2"),
                                           engine))
    finally:
        runner.close()
    assert trajectory.info["tool_errors"] == 1
    assert tokenizer.decode(trajectory.segments[1].token_ids, skip_special_tokens=True).split() == [
        "user:", "<tool_response>", "error", "</tool_response>", "assistant:"]


def test_format_transcripts_call_the_prompts_table_and_relay_the_result(tokenizer):
    import random

    ids, mask = agent_task.warm_transcripts(tokenizer, 64, random.Random(0))
    tools = load_tools(TOOLS)
    asked_right = 0
    for row, row_mask in zip(ids.tolist(), mask.tolist()):
        tokens = tokenizer.convert_ids_to_tokens(row)
        key, table = tokens[11].strip('"'), tokens[13].strip('"')  # look up "k_" in "t_"
        start = tokens.index("<tool_call>")
        (call,) = parse_tool_calls(tokenizer.decode(row[start:start + 19]), tools)
        assert call.arguments["table"] == table
        asked_right += call.arguments["key"] == key
        assert tokens[-2] == lookup(table, call.arguments["key"]) and tokens[-1] == "<eos>"
        # Trained on: the call and the answer (the model's turns), not the prompt or the result.
        assert [t for t, m in zip(tokens, row_mask) if m] == tokens[start:start + 20] + tokens[-2:]
    assert asked_right < 64 * 0.5  # mostly a random key


def test_the_warm_starts_prior_is_the_share_of_calls_that_ask_the_prompts_key(tokenizer):
    """docs/03's ablation (a weaker prior, none) writes the task with another key_hint."""
    import random

    tools = load_tools(TOOLS)

    def asked_right(key_hint):
        ids, _ = agent_task.warm_transcripts(tokenizer, 64, random.Random(0), key_hint)
        right = 0
        for row in ids.tolist():
            tokens = tokenizer.convert_ids_to_tokens(row)
            start = tokens.index("<tool_call>")
            (call,) = parse_tool_calls(tokenizer.decode(row[start:start + 19]), tools)
            right += call.arguments["key"] == tokens[11].strip('"')  # look up "k_" in "t_"
        return right

    # 1: every call asks the prompt's key; 0: a random key among KEYS (1 in 8 by chance).
    assert asked_right(1.0) == 64 and asked_right(0.0) < 64 * 0.3


def _write(out, monkeypatch, steps=2):
    monkeypatch.setattr(agent_task, "WARM_STEPS", steps)
    return make_agent_task(out, num_prompts=20)


def test_writer_is_deterministic_and_leaves_no_partial_task(tmp_path, monkeypatch):
    first, second = _write(tmp_path / "a", monkeypatch), _write(tmp_path / "b", monkeypatch)
    for name in ("prompts.jsonl", "eval.jsonl", "model/model.safetensors", "model/config.json", "model/tokenizer.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    record = json.loads((first / "prompts.jsonl").read_text().splitlines()[0])
    key, table = (word.strip('"') for word in record["prompt"].split()[2::2])
    assert record["answer"] == lookup(table, key)

    def broken(model_dir, seed, steps, key_hint):
        raise RuntimeError("interrupted")

    monkeypatch.setattr(agent_task, "warm_start", broken)
    with pytest.raises(RuntimeError):
        _write(tmp_path / "c", monkeypatch)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]
