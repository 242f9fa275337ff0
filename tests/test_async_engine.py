"""The asynchronous mode's exactness claim, against a real SGLang 0.5.23 server on CPU: a response
continued across a weight update (pause with retract, new weights, continue) carries each token's
weight version, and each token's engine log-prob is the log-prob of that token under the weights
of its version (float32 engine), so its sequence ratio is exact with nothing regenerated."""

import threading
import time

import pytest
import torch

from gspo_mcore.megatron.qwen3_moe.tiny import make_tiny_checkpoint
from gspo_mcore.common.netaddr import free_port
from gspo_mcore.common.processes import ManagedServer
from gspo_mcore.engines.sglang.client import SGLangClient
from gspo_mcore.engines.sglang.engine import SGLangEngine
from gspo_mcore.engines.sglang.server import sglang_command
from gspo_mcore.engines.sglang.sglang_cpu import server_env

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("async_engine")]

# Long responses: the pause must land before the server decodes them all, and a loaded machine
# can hold the test's thread back for as long as the server decodes 60 tokens (a run with 64: no
# response spanned both versions).
NEW_TOKENS = 192


def _reference_logprobs(hf_dir, rollout) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    sequence = torch.tensor([rollout.prompt_ids + rollout.response_ids])
    with torch.no_grad():
        logits = model(input_ids=sequence[:, :-1]).logits[0].double()
    first = len(rollout.prompt_ids) - 1
    return logits.log_softmax(-1)[first:].gather(-1, torch.tensor(rollout.response_ids)[:, None])[:, 0]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """A float32 server, and two checkpoints of different weights (versions 0 and 1)."""
    root = tmp_path_factory.mktemp("async_engine")
    old = make_tiny_checkpoint(root / "old", seed=0, mlp_only_layers=[])
    new = make_tiny_checkpoint(root / "new", seed=1, mlp_only_layers=[])
    port = free_port()
    log = root / "sglang.log"
    # A log line per decode iteration (40 by default): the push lands after a token or two, not
    # after 40 (CI: no response spanned both).
    cmd = sglang_command(str(old), port, dtype="float32",
                         extra_args=("--disable-radix-cache", "--decode-log-interval", "1"))
    with ManagedServer(cmd, f"http://127.0.0.1:{port}", log, env=server_env(), startup_timeout_s=300) as server:
        yield server.url, log, old, new


def _generate_across_a_push(engine, client: SGLangClient, keep_tokens: bool):
    """Three long responses; once the server decodes them (the prefill made their first token
    under version 0), pause, push version 1, continue."""
    url, log, old, new = engine
    control = SGLangEngine([url])
    control.load_from_disk(old, "step-0")
    prompts = [[1, 5, 9, 33], [7, 7, 100], [200, 3, 4, 5, 6, 7]]
    result = {}
    worker = threading.Thread(target=lambda: result.update(rollouts=client.generate(
        prompts, {"max_new_tokens": NEW_TOKENS, "temperature": 1.0, "ignore_eos": True})))
    decoded_before = log.read_text().count("Decode batch")
    worker.start()
    deadline = time.monotonic() + 120
    while log.read_text().count("Decode batch") < decoded_before + 1 and time.monotonic() < deadline:
        time.sleep(0.05)  # update once the server is decoding the batch
    if not keep_tokens:
        client.interrupt()
    control.pause(keep_tokens=keep_tokens)
    control.load_from_disk(new, "step-1")
    control.resume()
    client.end_interrupt()
    worker.join(timeout=300)
    return result["rollouts"]


def test_a_response_spanning_two_weight_versions_is_exact_under_each(engine):
    _, _, old, new = engine
    client = SGLangClient([engine[0]], 256)
    rollouts = _generate_across_a_push(engine, client, keep_tokens=True)
    spanning = [r for r in rollouts if set(r.token_versions) == {0, 1}]
    assert spanning, [r.token_versions for r in rollouts]
    assert client.tokens_regenerated == 0
    for r in rollouts:
        assert len(r.response_ids) == NEW_TOKENS and len(r.token_versions) == NEW_TOKENS  # nothing regenerated
        versions = torch.tensor(r.token_versions)
        assert (versions.diff() >= 0).all()  # one switch, old weights first
        engine_lp = torch.tensor(r.logprobs, dtype=torch.float64)
        under_old, under_new = _reference_logprobs(old, r), _reference_logprobs(new, r)
        reference = torch.where(versions == 0, under_old, under_new)
        assert (engine_lp - reference).abs().max().item() < 1e-5, (engine_lp - reference).abs().max().item()
        if r in spanning:  # the versions matter: the other weights' log-probs are far off
            assert (engine_lp - torch.where(versions == 0, under_new, under_old)).abs().max().item() > 0.1


def test_without_partial_rollouts_a_push_restarts_the_responses_in_flight(engine):
    """rollout.partial: false, for comparison: the push aborts the requests in flight (pause mode
    abort), the client starts them over at once (no attempt used), every token is of the new
    version, and the thrown-away tokens are counted."""
    _, _, _, new = engine
    client = SGLangClient([engine[0]], 256, max_attempts=1)  # a restart must not count as a failed attempt
    rollouts = _generate_across_a_push(engine, client, keep_tokens=False)
    assert client.tokens_regenerated > 0
    for r in rollouts:
        assert len(r.response_ids) == NEW_TOKENS and set(r.token_versions) == {1}
        assert (torch.tensor(r.logprobs, dtype=torch.float64) - _reference_logprobs(new, r)).abs().max().item() < 1e-5
