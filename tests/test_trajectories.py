"""Multi-turn trajectories: the environment's tokens are fed to the model but never trained on
(mask 0: exactly zero gradient, and GSPO's length normalisation counts the model's tokens only),
environment turns are spliced in by tokens from the chat template, and against a real float32
server each model token's engine log-prob is the trainer-side log-prob of that token in the
whole three-turn sequence."""

import asyncio

import pytest
import torch

from gspo_mcore.common.errors import RolloutError
from gspo_mcore.gspo.packing import collate
from gspo_mcore.batch.rollout import Rollout
from gspo_mcore.batch.trajectory import Segment, Trajectory, to_rollout
from helpers import ScriptedClient
from rollout_fixtures import three_turns


def _trajectory() -> Trajectory:
    t = Trajectory(prompt_ids=[5, 6, 7])
    t.add_model(Rollout([5, 6, 7], [10, 11], [-0.5, -0.25], "stop", "step-3", token_versions=(3, 3)))
    t.add_environment([20, 21, 22])
    t.add_model(Rollout([], [12], [-1.0], "stop", "step-4", token_versions=(4,)))
    return t


def test_a_trajectory_becomes_a_rollout_with_the_environment_masked():
    r = to_rollout(_trajectory(), "t")
    assert r.prompt_ids == [5, 6, 7] and r.response_ids == [10, 11, 20, 21, 22, 12]
    assert r.loss_mask == (1, 1, 0, 0, 0, 1) and r.logprobs == [-0.5, -0.25, 0, 0, 0, -1.0]
    assert r.token_versions == (3, 3, 3, 3, 3, 4) and r.oldest_version == 3 and r.weight_version == "step-4"
    batch = collate([r])
    # position t predicts token t + 1: the prompt's last position predicts the first response token
    assert batch["mask"][0].tolist() == [0, 0, 1, 1, 0, 0, 0, 1]
    with pytest.raises(RolloutError, match="a model segment of 2 tokens with 1 log-probs"):
        to_rollout(Trajectory([1], [Segment([2, 3], True, [-1.0])]), "bad")
    with pytest.raises(RolloutError, match="no model tokens"):
        to_rollout(Trajectory([1], [Segment([2, 3], False)]), "env-only")


def test_the_last_model_turns_routing_covers_every_segment():
    """Row t routes the forward whose input is token t of prompt + response; the last turn's
    request held every earlier token, and trailing environment tokens repeat its last row."""
    import numpy as np

    def rollout(response, routed_rows):
        routing = np.arange(routed_rows * 2 * 2, dtype=np.int32).reshape(routed_rows, 2, 2)
        return Rollout([], response, [-1.0] * len(response), "stop", "step-1", routing, token_versions=(1,) * len(response))

    t = Trajectory(prompt_ids=[5, 6, 7])
    t.add_model(rollout([10, 11], 4))  # prompt 3 + 2 tokens: 4 inputs
    t.add_environment([20, 21])
    t.add_model(rollout([12], 7))  # 3 + 2 + 2 + 1 tokens: 7 inputs
    r = to_rollout(t, "t")
    assert r.routed_experts.shape == (7, 2, 2) and (r.routed_experts == t.segments[-1].routed_experts).all()
    t.add_environment([22, 23])  # a function that ends on environment tokens
    r = to_rollout(t, "t")
    assert r.routed_experts.shape == (9, 2, 2) and (r.routed_experts[7:] == r.routed_experts[6]).all()
    short = Trajectory(prompt_ids=[5, 6, 7])
    short.add_model(rollout([10, 11], 4))
    short.add_environment([20, 21])
    short.add_model(rollout([12], 3))  # generated from the last turn's tokens only
    with pytest.raises(RolloutError, match="routed experts cover 3 tokens, not the 7 before its last token"):
        to_rollout(short, "short")
    mixed = Trajectory(prompt_ids=[5, 6, 7])
    mixed.add_model(rollout([10, 11], 4))
    mixed.add_model(Rollout([], [12], [-1.0], "stop", "step-1"))
    with pytest.raises(RolloutError, match="routed experts for some model turns only"):
        to_rollout(mixed, "mixed")


def test_environment_tokens_get_exactly_zero_gradient_and_do_not_count_in_the_length():
    from gspo_mcore.config import LossConfig
    from gspo_mcore.gspo.loss import objective, sequence_log_ratio

    r = to_rollout(_trajectory())
    batch = collate([r, Rollout([5, 6, 7], [10, 11, 12], [-0.5, -0.25, -1.0], "stop", "step-4")])
    torch.manual_seed(0)
    logp = (batch["old_logprobs"] + 0.01 * torch.randn(batch["mask"].shape)).requires_grad_()
    inputs = {"old_logprobs": batch["old_logprobs"], "mask": batch["mask"], "advantages": torch.tensor([1.0, -1.0])}
    loss, _ = objective(logp, inputs, LossConfig(clip_low=0.5, clip_high=0.5))
    (grad,) = torch.autograd.grad(loss, logp)
    env = torch.zeros_like(batch["mask"], dtype=torch.bool)
    env[0, 4:7] = True
    assert grad[env].abs().max().item() == 0.0 and (grad[0][batch["mask"][0] > 0] != 0).all()
    # s_i averages over the 3 model tokens of the 6 after the prompt
    expected = (logp - batch["old_logprobs"])[0][batch["mask"][0] > 0].sum() / 3
    assert sequence_log_ratio(logp, batch["old_logprobs"], batch["mask"])[0].item() == pytest.approx(expected.item())


def test_environment_ids_splice_a_turn_as_the_chat_template_renders_it(tmp_path):
    from transformers import AutoTokenizer

    from gspo_mcore.rollout.engine_handle import environment_ids
    from gspo_mcore.tasks.toy import make_tokenizer

    make_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    after = tok.encode("color_3 <eos>", add_special_tokens=False)
    env = environment_ids(tok, [{"role": "user", "content": "name a fruit"}], after)
    assert tok.convert_ids_to_tokens(env) == ["user:", "name", "a", "fruit", "assistant:"]
    # The whole conversation rendered and tokenized has the same tokens (for this template).
    from gspo_mcore.data import chat_prompt_ids

    whole = chat_prompt_ids(tok, [{"role": "user", "content": "name a color"},
                                  {"role": "assistant", "content": "color_3"}, {"role": "user", "content": "name a fruit"}])
    prompt = chat_prompt_ids(tok, [{"role": "user", "content": "name a color"}])
    assert whole == [*prompt, *tok.encode("color_3", add_special_tokens=False), *env]


@pytest.mark.slow
def test_each_model_token_of_three_turns_has_the_trainers_log_prob_and_routing(tmp_path):
    """With the prefix cache on (each trajectory sticks to its server): the engine's log-probs
    of every model token, and its routed experts of every token (the last turn's request covers
    the earlier turns and the environment's), are the trainer side's."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from gspo_mcore.common.netaddr import free_port
    from gspo_mcore.common.processes import ManagedServer
    from gspo_mcore.engines.sglang.client import SGLangClient
    from gspo_mcore.rollout.engine_handle import EngineHandle, Task
    from gspo_mcore.rollout.functions import run_functions
    from gspo_mcore.engines.sglang.server import sglang_command
    from gspo_mcore.engines.sglang.sglang_cpu import server_env
    from gspo_mcore.tasks.toy import make_toy_task

    model_dir = make_toy_task(tmp_path / "toy", seed=0) / "model"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    port = free_port()
    cmd = sglang_command(str(model_dir), port, dtype="float32", extra_args=("--enable-return-routed-experts",))
    arch = AutoConfig.from_pretrained(model_dir)
    tasks = [Task([{"role": "user", "content": "name a color ( animal_1 fruit_2 )"}], "color"),
             Task([{"role": "user", "content": "name an animal ( color_1 )"}], "animal")]
    with ManagedServer(cmd, f"http://127.0.0.1:{port}", tmp_path / "sglang.log", env=server_env()) as server:
        client = SGLangClient([server.url], 256, routing_shape=(arch.num_hidden_layers, arch.num_experts_per_tok))
        groups = run_functions(three_turns, tasks, 2, lambda i, k: EngineHandle(
            client, tokenizer, 0, {"temperature": 1.0, "max_new_tokens": 5}, seed=100 * i + k), concurrency=4)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for trajectory in (t for group in groups for t in group):
        assert sum(s.trainable for s in trajectory.segments) == 3
        r = to_rollout(trajectory)
        sequence = torch.tensor([r.prompt_ids + r.response_ids])
        with torch.no_grad():
            output = model(input_ids=sequence[:, :-1], output_router_logits=True)
        logits = output.logits[0].double()
        reference_routing = torch.stack([layer.topk(arch.num_experts_per_tok, -1).indices.sort(-1).values
                                         for layer in output.router_logits], 1)  # [tokens, layers, top-k]
        routed = torch.from_numpy(r.routed_experts.astype("int64")).sort(-1).values
        assert routed.shape == reference_routing.shape
        assert (routed == reference_routing).all(-1).float().mean().item() > 0.99  # float32 near-ties aside
        first = len(r.prompt_ids) - 1
        reference = logits.log_softmax(-1)[first:].gather(-1, torch.tensor(r.response_ids)[:, None])[:, 0]
        trained = torch.tensor(r.loss_mask) > 0
        engine = torch.tensor(r.logprobs, dtype=torch.float64)
        assert (engine - reference)[trained].abs().max().item() < 1e-5
        assert (engine[~trained] == 0).all()


def test_run_functions_keeps_each_tasks_trajectories_together():
    from gspo_mcore.rollout.engine_handle import Task
    from gspo_mcore.rollout.functions import run_functions

    async def echo(task, engine):
        await asyncio.sleep(0.01 * (3 - engine))  # finishing out of order
        return [Trajectory([len(task.answer)], text=f"{task.answer}-{engine}")] * (2 if engine == 0 else 1)

    groups = run_functions(echo, [Task([], "a"), Task([], "bb")], 2, lambda i, k: k, concurrency=2)
    assert [[t.text for t in g] for g in groups] == [["a-0", "a-0", "a-1"], ["bb-0", "bb-0", "bb-1"]]


def test_run_functions_keeps_as_many_engine_calls_in_flight_as_asked():
    """Engine calls wait in threads: all 16 must be waiting at once (asyncio's default pool,
    min(32, cores + 4) threads, held 6 here and broke the barrier)."""
    import threading

    from gspo_mcore.rollout.engine_handle import Task
    from gspo_mcore.rollout.functions import run_functions

    barrier = threading.Barrier(16)

    async def wait_for_all(task, engine):
        await asyncio.to_thread(barrier.wait, 20)
        return Trajectory([1], text="ok")

    groups = run_functions(wait_for_all, [Task([], "a")] * 4, 4, lambda i, k: None, concurrency=16)
    assert sum(len(g) for g in groups) == 16


def _byte_tokenizer(tmp_path):
    """Bytes + Qwen3's chat markers (the tool template needs them): any text encodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from gspo_mcore.tools.runner import QWEN3_TOOL_TEMPLATE

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokenizer = Tokenizer(models.BPE({c: i for i, c in enumerate(sorted(alphabet))}, [], fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    fast.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    fast.chat_template = QWEN3_TOOL_TEMPLATE
    return fast


def test_a_tool_that_fails_on_every_call_stops_the_run_naming_it(tmp_path):
    """The tool raises on every call: the step stops as the user's error, quoting the tool's
    exception in one line, every failure kept in logs/tool_errors.log. Before, the run trained on
    the error messages with exit 0 and `tool_errors` in metrics.jsonl only. (The real tool loop,
    tool workers and rollout source; a scripted model that calls the tool.)"""
    from types import SimpleNamespace

    from gspo_mcore.common.errors import InputError
    from gspo_mcore.config import load_config
    from gspo_mcore.rollout.engine_handle import EngineHandle, Task
    from gspo_mcore.rollout.source import RolloutSource
    from gspo_mcore.rollout.tool_loop import tool_loop
    from gspo_mcore.tasks.toy import make_prompts, make_tokenizer
    from gspo_mcore.tools.runner import ToolRunner

    tokenizer = _byte_tokenizer(tmp_path)
    call = '<tool_call>\n{"name": "lookup", "arguments": {"table": "t_1", "key": "k_2"}}\n</tool_call>'
    config = SimpleNamespace(max_turns=2, max_trajectory_tokens=4096, max_new_tokens=200)
    runner = ToolRunner(["tests.broken_tools:lookup"], workers=1, timeout_s=30)
    try:
        infos = []
        for i in range(3):
            model = ScriptedClient.replying(tokenizer, [call, "k_2 is v_7"])
            engine = EngineHandle(model, tokenizer, i, {"temperature": 1.0}, seed=i, config=config, tools=runner)
            infos.append(asyncio.run(tool_loop(Task([{"role": "user", "content": "look k_2 up"}], "v_7"), engine)).info)
    finally:
        runner.close()
    assert all(info["tool_runs"] == 1 and len(info["tool_failures"]) == 1 for info in infos), infos

    make_tokenizer(tmp_path / "toy")
    make_prompts(tmp_path / "prompts.jsonl", 8, seed=0)
    source = RolloutSource(load_config(None, [f"data.path={tmp_path / 'prompts.jsonl'}",
                                              f"data.tokenizer_dir={tmp_path / 'toy'}", "reward.workers=1",
                                              "rollout.function=tool_loop", "rollout.tools=[tests.broken_tools:lookup]"]))
    source.error_log = tmp_path / "logs" / "reward_errors.log"
    try:
        with pytest.raises(InputError) as raised:
            source.step_metrics([{"turns": infos}])
    finally:
        source.close()
    said = str(raised.value)
    assert "\n" not in said and said.startswith("rollout.tools tests.broken_tools:lookup: all 3 tool calls of this "
                                                  "step failed; the first: "), said
    assert "raised KeyError" in said and "the tables were never loaded" in said and "tool_errors.log" in said, said
    logged = (tmp_path / "logs" / "tool_errors.log").read_text().splitlines()
    assert len(logged) == 3 and all("raised KeyError" in line for line in logged)


def test_the_tool_loop_calls_tools_and_splices_their_results_in_as_the_template_renders_them(tmp_path):
    from types import SimpleNamespace

    from gspo_mcore.rollout.engine_handle import EngineHandle, Task
    from gspo_mcore.rollout.tool_loop import tool_loop
    from gspo_mcore.tools.runner import ToolRunner

    tokenizer = _byte_tokenizer(tmp_path)
    call = '<tool_call>\n{"name": "lookup", "arguments": {"key": "rome"}}\n</tool_call>'
    model = ScriptedClient.replying(tokenizer, [call, '<tool_call>\n{"name": "nope"}\n</tool_call>', "Italy"])
    config = SimpleNamespace(max_turns=4, max_trajectory_tokens=4096, max_new_tokens=200)
    runner = ToolRunner(["tool_fixtures:lookup"], workers=1, timeout_s=30)
    try:
        engine = EngineHandle(model, tokenizer, 0, {"temperature": 1.0}, seed=0, config=config, tools=runner)
        task = Task([{"role": "user", "content": "Which country is Rome in?"}], "Italy")
        trajectory = asyncio.run(tool_loop(task, engine))
    finally:
        runner.close()
    assert [s.trainable for s in trajectory.segments] == [True, False, True, False, True]
    assert trajectory.text == "Italy" and trajectory.finish_reason == "stop"
    # Two calls: one ran (and answered), one malformed (never run).
    assert trajectory.info == {"tool_calls": 2, "tool_errors": 1, "tool_timeouts": 0, "tool_runs": 1,
                               "tool_failures": []}
    assert sum(s.trainable for s in trajectory.segments) == 3
    # Every turn's input is the prompt and every token so far: model tokens as sampled, never re-tokenized.
    assert model.inputs[2] == trajectory.prompt_ids + [t for s in trajectory.segments[:4] for t in s.token_ids]
    # The environment's tokens are the chat template's rendering of the tool results.
    whole = tokenizer.apply_chat_template(
        [*task.messages, {"role": "assistant", "content": call}, {"role": "tool", "name": "lookup", "content": "Italy"}],
        tools=runner.tools.schemas, add_generation_prompt=True, tokenize=False)
    spliced = tokenizer.decode(trajectory.prompt_ids + trajectory.segments[0].token_ids + trajectory.segments[1].token_ids)
    assert spliced == whole
    assert "error: unknown tool 'nope'" in tokenizer.decode(trajectory.segments[3].token_ids)


def test_the_tool_loop_stops_at_the_trajectory_budget(tmp_path):
    from types import SimpleNamespace

    from gspo_mcore.rollout.engine_handle import EngineHandle, Task
    from gspo_mcore.rollout.tool_loop import tool_loop
    from gspo_mcore.tools.runner import ToolRunner

    tokenizer = _byte_tokenizer(tmp_path)
    call = '<tool_call>\n{"name": "lookup", "arguments": {"key": "paris"}}\n</tool_call>'
    model = ScriptedClient.replying(tokenizer, [call] * 4)
    runner = ToolRunner(["tool_fixtures:lookup"], workers=1, timeout_s=30)
    try:
        engine = EngineHandle(model, tokenizer, 0, {"temperature": 1.0}, seed=0, tools=runner,
                              config=SimpleNamespace(max_turns=4, max_trajectory_tokens=120, max_new_tokens=200))
        trajectory = asyncio.run(tool_loop(Task([{"role": "user", "content": "Paris?"}], "France"), engine))
    finally:
        runner.close()
    assert trajectory.finish_reason == "length" and len(trajectory.token_ids) <= 120


def test_a_request_the_engine_refuses_is_the_rollout_functions_error():
    """The README's ask_twice asked for more tokens than the engine's context: exit 3 (an engine
    failure) with the engine's message cut mid-sentence. It is the function's doing: one line
    naming it, the tokens it asked for, and the engine's whole message; exit 2."""
    import asyncio

    from gspo_mcore.config import RolloutConfig
    from gspo_mcore.common.errors import InputError, RequestRefused
    from gspo_mcore.rollout.engine_handle import EngineHandle

    class Refusing:
        async def generate_one_async(self, *request, evaluation=False):
            raise RequestRefused("server http://s refused the request: HTTP 400: Requested token count exceeds the "
                                 "model's maximum context length of 512 tokens.")

    handle = EngineHandle(Refusing(), None, 0, {"max_new_tokens": 256, "temperature": 1.0}, 0,
                          RolloutConfig(function="mypkg.rollouts:ask_twice"))
    with pytest.raises(InputError, match=r"^rollout.function mypkg.rollouts:ask_twice: the engine refused its request "
                                         r"of 300 tokens with max_new_tokens 256 \(server http://s refused the request: "
                                         r"HTTP 400: Requested token count exceeds .* 512 tokens.\)$"):
        asyncio.run(handle.generate(list(range(300))))


async def always_fails(task, engine):
    raise KeyError("answer")


def test_a_rollout_function_that_raises_is_the_users_error_naming_it():
    """It surfaced as a traceback (a bug's exit 1) from inside asyncio."""
    from gspo_mcore.common.errors import InputError
    from gspo_mcore.rollout.engine_handle import Task
    from gspo_mcore.rollout.functions import run_functions

    with pytest.raises(InputError, match=r"^rollout.function test_trajectories:always_fails: raised KeyError: 'answer' "
                                         r"\(at .*test_trajectories.py:\d+; task 0, call 0\)$"):
        run_functions(always_fails, [Task([{"role": "user", "content": "q"}], "a")], 2, lambda i, k: None, 2)
