"""The rollout client's retries and the server lifecycle, against a local stand-in server
(tests/fixtures/fake_engine.py) that can fail, die mid-batch and come back."""

import json
import sys
import threading
import time

import pytest

from conftest import REPO
from gspo_mcore.errors import InputError
from gspo_mcore.netaddr import free_port
from gspo_mcore.engines.base import check_sampling_params
from gspo_mcore.engines.sglang.client import SGLangClient
from gspo_mcore.errors import RolloutError
from gspo_mcore.processes import ManagedServer
from gspo_mcore.engines.sglang.server import sglang_command

PARAMS = {"max_new_tokens": 4, "temperature": 1.0}
PROMPTS = [[i, i + 1, 3] for i in range(12)]


def fake_server(tmp_path, port, *flags):
    cmd = [sys.executable, str(REPO / "tests" / "fixtures" / "fake_engine.py"), "--port", str(port),
           "--record", str(tmp_path / "answered.jsonl"), *flags]
    return ManagedServer(cmd, f"http://127.0.0.1:{port}", tmp_path / f"server-{port}.log", startup_timeout_s=30)


def expected_ids(prompt):
    return [(sum(prompt) + 7 * k) % 256 for k in range(PARAMS["max_new_tokens"])]


def test_generate_in_order(tmp_path):
    port = free_port()
    with fake_server(tmp_path, port):
        rollouts = SGLangClient([f"http://127.0.0.1:{port}"], 256).generate(PROMPTS, PARAMS)
    assert [r.response_ids for r in rollouts] == [expected_ids(p) for p in PROMPTS]
    assert [r.prompt_ids for r in rollouts] == PROMPTS


def test_lifecycle_leaves_no_process(tmp_path):
    port = free_port()
    server = fake_server(tmp_path, port).start()
    pid = server.process.pid
    assert server.healthy()
    server.stop()
    assert server.process.poll() is not None and not server.healthy()
    with pytest.raises(ProcessLookupError):
        import os
        os.killpg(pid, 0)


def test_server_that_exits_at_startup_is_reported(tmp_path):
    server = ManagedServer([sys.executable, "-c", "raise SystemExit(3)"], "http://127.0.0.1:9", tmp_path / "s.log")
    with pytest.raises(InputError, match="exited with code 3 while starting"):
        server.start()


def test_killed_mid_batch_and_restarted_loses_and_duplicates_nothing(tmp_path):
    port = free_port()
    first = fake_server(tmp_path, port, "--die-after", "5").start()
    restarted = {}

    def restart_when_dead():
        first.process.wait()
        time.sleep(0.5)
        restarted["server"] = fake_server(tmp_path, port).start()

    watcher = threading.Thread(target=restart_when_dead)
    watcher.start()
    try:
        client = SGLangClient([f"http://127.0.0.1:{port}"], 256, max_attempts=8, backoff_s=0.5, max_concurrency=4)  # ~2 min of retries: a loaded machine restarts slowly
        rollouts = client.generate(PROMPTS, PARAMS)
    finally:
        watcher.join(timeout=60)
        first.stop()
        if "server" in restarted:
            restarted["server"].stop()
    assert [r.response_ids for r in rollouts] == [expected_ids(p) for p in PROMPTS]
    # Every prompt came back exactly once, in its slot (above). The servers answered every prompt;
    # one whose reply died with the server may have been answered twice, which the client absorbs.
    answered = [tuple(json.loads(line)) for line in (tmp_path / "answered.jsonl").read_text().splitlines()]
    assert set(answered) == set(map(tuple, PROMPTS))


def test_server_gone_for_good_is_a_clear_error_in_bounded_time(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    client = SGLangClient([url], 256, max_attempts=3, backoff_s=0.1)
    start = time.monotonic()
    with pytest.raises(RolloutError, match=rf"request \d+: failed after 3 attempts; last: server {url}"):
        client.generate(PROMPTS[:2], PARAMS)
    assert time.monotonic() - start < 10


def test_5xx_is_retried_and_a_dead_server_is_skipped(tmp_path):
    port = free_port()
    with fake_server(tmp_path, port, "--fail-first", "3"):
        dead = f"http://127.0.0.1:{free_port()}"
        client = SGLangClient([dead, f"http://127.0.0.1:{port}"], 256, max_attempts=6, backoff_s=0.05)
        rollouts = client.generate(PROMPTS, PARAMS)
    assert [r.response_ids for r in rollouts] == [expected_ids(p) for p in PROMPTS]


@pytest.mark.parametrize("params", [{"top_p": 0.9}, {"top_k": 20}, {"min_p": 0.1}, {"temperature": 0.0}])
def test_truncated_or_greedy_sampling_is_refused(params):
    with pytest.raises(InputError, match="sampling:"):
        check_sampling_params({**PARAMS, **params})


def test_sglang_command(tmp_path):
    from gspo_mcore.models.qwen3_moe.tiny import make_tiny_checkpoint

    all_moe = make_tiny_checkpoint(tmp_path / "moe", mlp_only_layers=[])
    cmd = sglang_command(str(all_moe), 30000)
    assert cmd[1:3] == ["-m", "sglang.launch_server"] and "--skip-tokenizer-init" in cmd
    assert cmd[cmd.index("--max-total-tokens") + 1] == "8192" and "torch_native" in cmd
    # Stop strings are matched on text: a server the run starts for them loads the tokenizer.
    from gspo_mcore.config import load_config
    from gspo_mcore.engines.sglang.server import server_for_config

    config = load_config(None, [f"model.hf_dir={all_moe}", "rollout.stop=['</answer>']", "data.tokenizer_dir=/tok"])
    cmd, _ = server_for_config(config, 30000)
    assert "--skip-tokenizer-init" not in cmd and cmd[cmd.index("--tokenizer-path") + 1] == "/tok"
    with_dense_layer = make_tiny_checkpoint(tmp_path / "dense", mlp_only_layers=[1])
    with pytest.raises(InputError, match="runs Qwen3-MoE dense layers"):
        sglang_command(str(with_dense_layer), 30000)


def test_a_request_restarted_during_an_aborting_push_is_restarted_again_if_aborted_again():
    """rollout.partial false: the push aborts the requests in flight and the client restarts them
    at once, so the restart waits on the paused server, registered there; SGLang's abort-mode
    pause aborts every registered request each second until none runs, so the restart can be
    aborted too, and its answer arrives after /continue_generation. That abort is the push's as
    well: the request starts over again, using no attempt (it failed the run with
    max_attempts 1 in CI: test_async_engine's restart test)."""
    client = SGLangClient(["http://stand-in"], 256, max_attempts=1)
    answers = []

    def post(url, body):
        answers.append(body["input_ids"])
        if len(answers) == 1:  # in flight when the push starts: aborted by it
            client.interrupt()
            return {"meta_info": {"finish_reason": {"type": "abort"}, "completion_tokens": 2}}
        if len(answers) == 2:  # the restart, sent during the push: aborted by the pause's next round,
            client.end_interrupt()  # its answer arriving once the push is over
            return {"meta_info": {"finish_reason": {"type": "abort"}, "completion_tokens": 0}}
        return {"output_ids": [5, 6], "meta_info": {"output_token_logprobs": [[-0.5, 5, None], [-0.25, 6, None]],
                                                    "finish_reason": {"type": "stop"}, "weight_version": "v"}}

    client._post = post
    [rollout] = client.generate([[1, 2, 3]], PARAMS)
    assert rollout.response_ids == [5, 6] and len(answers) == 3 and client.tokens_regenerated == 2
    # Once the push is over, an abort is the server's: it uses an attempt.
    answers.clear()
    answers.append(None)  # the next answer is the second kind: an abort, no push under way
    with pytest.raises(RolloutError, match="failed after 1 attempts"):
        client.generate([[1, 2, 3]], PARAMS)
