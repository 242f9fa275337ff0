"""The agent task as its writer ships it (configs/agent_cpu.yaml's model): the warm model calls
the tool in format. Its learning test (the mean reward up by >= 0.3 from the first 10 steps to
the last 10, under 10 minutes) is not here yet: 2 of 4 runs collapsed (issue #21 stays open)."""

import json

import pytest
import torch
from transformers import AutoTokenizer

from gspo_mcore.agent_task import lookup, make_agent_task
from gspo_mcore.rollout.tools import ToolCall, load_tools, parse_tool_calls

TOOLS = ["gspo_mcore.agent_task:lookup"]

# Slow: the writer's warm start (~20 s idle, minutes on a busy machine). Its own xdist group.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("agent_cpu")]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """The task as shipped (~20 s: the warm start)."""
    return make_agent_task(tmp_path_factory.mktemp("agent") / "task")


def test_the_warm_model_calls_the_tool_in_format_with_the_prompts_table(task):
    """The writer as shipped: greedy from the warm model, the call parses, names the prompt's
    table, and the model relays the tool's result."""
    from transformers import AutoModelForCausalLM

    from gspo_mcore.rollout.functions import environment_ids

    tokenizer = AutoTokenizer.from_pretrained(task / "model")
    model = AutoModelForCausalLM.from_pretrained(task / "model", dtype=torch.float32).eval()
    tools = load_tools(TOOLS)

    def greedy(ids, count):
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=count, do_sample=False,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        return out[0, len(ids):].tolist()

    records = [json.loads(line) for line in (task / "prompts.jsonl").read_text().splitlines()[:16]]
    in_format = relayed = 0
    for record in records:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": record["prompt"]}], tools=tools.schemas,
                                               add_generation_prompt=True, tokenize=False)
        prompt = tokenizer.encode(prompt, add_special_tokens=False)
        reply = greedy(prompt, 24)
        calls = parse_tool_calls(tokenizer.decode(reply, skip_special_tokens=True), tools)
        table = record["prompt"].split()[-1].strip('"')
        if len(calls) == 1 and isinstance(calls[0], ToolCall) and calls[0].arguments["table"] == table:
            in_format += 1
            value = lookup(**calls[0].arguments)
            result = environment_ids(tokenizer, [{"role": "tool", "name": "lookup", "content": value}], reply)
            relayed += tokenizer.decode(greedy(prompt + reply + result, 2), skip_special_tokens=True).split()[:1] == [value]
    assert in_format >= 14 and relayed >= in_format - 2, (in_format, relayed)
