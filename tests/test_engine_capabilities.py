"""An engine is its core (gspo_mcore/engines/base.py) plus the capabilities it declares
(gspo_mcore/engines/capabilities.py): an engine of the core alone constructs and generates, and a
config that asks for a capability it lacks is refused in one line naming the field, before any
server starts."""

import re

import pytest

from conftest import REPO
import torch

from gspo_mcore.config import ConfigError, load_config
from gspo_mcore.engines import ENGINES, engine_class
from gspo_mcore.engines.base import Engine, EngineMemory
from gspo_mcore.engines.capabilities import (PUSH, DiskLoad, MemoryRelease, ProcessGroupPush, SharedMemoryPush,
                                             SyncProbe, asked)
from gspo_mcore.engines.client import EngineClient
from gspo_mcore.common.errors import InputError, WeightSyncError
from gspo_mcore.batch.rollout import Rollout


class EchoClient(EngineClient):
    """Answers each prompt with its last token repeated, at log-prob -1 each (no HTTP)."""
    name = "echo-client"

    def abort_all(self, url: str) -> None:
        pass

    async def request(self, url, index, prompt_ids, sampling_params, weight_version, oldest_version) -> Rollout:
        n = sampling_params["max_new_tokens"]
        return Rollout(prompt_ids, [prompt_ids[-1]] * n, [-1.0] * n, "length", weight_version or "step-0",
                       token_versions=(0,) * n, origin=(f"{url} id={index}",))


class CoreEngine(Engine):
    """The required interface and nothing else."""
    name = "core"
    client_class = EchoClient

    def __init__(self, urls, timeout_s=600.0, api_key=None):
        super().__init__(urls, timeout_s, api_key)
        self.paused = []

    @classmethod
    def launch_command(cls, config, port, host="127.0.0.1", api_key=None):
        return ["echo-server", "--port", str(port)], {}

    @classmethod
    def memory(cls, arch, engine_tp, total_params):
        return EngineMemory.bf16_over_tp(arch, engine_tp, total_params, margin_gb=1.0, usable_fraction=0.9)

    def healthy(self, url):
        return True

    def capacity(self, url, default, request_tokens=0):
        return default

    def pause(self, keep_tokens=True):
        self.paused.append(keep_tokens)

    def resume(self):
        self.paused.append("resumed")


def config(*overrides):
    return load_config(None, list(overrides))


# Each config field that asks for a capability, and the capability.
ASKING = [(("weight_sync.method=distributed",), "weight_sync.method=distributed", ProcessGroupPush),
          (("weight_sync.method=tensor", "weight_sync.colocate=true"), "weight_sync.method=tensor", SharedMemoryPush),
          (("weight_sync.method=disk",), "weight_sync.method=disk", DiskLoad),
          (("weight_sync.method=disk", "weight_sync.colocate=true"), "weight_sync.colocate=true", MemoryRelease),
          (("weight_sync.method=disk", "weight_sync.check_every=2"), "weight_sync.check_every=2", SyncProbe)]


def test_an_engine_of_the_core_alone_constructs_and_generates():
    engine = CoreEngine(["http://a/", "http://b"], api_key="k")
    assert engine.urls == ["http://a", "http://b"]
    client = engine.client(256, max_concurrency=4)
    try:
        rollouts = client.generate([[5, 6, 7], [9]], {"max_new_tokens": 2, "temperature": 1.0}, weight_version="step-3")
    finally:
        client.close()
    assert [r.response_ids for r in rollouts] == [[7, 7], [9, 9]] and client.api_key == "k"
    engine.pause(keep_tokens=False)
    engine.resume()
    assert engine.paused == [False, "resumed"]
    with pytest.raises(InputError, match="^rollout: no server URLs$"):
        CoreEngine([])


def test_an_engine_missing_a_core_method_does_not_construct():
    class NoPause(CoreEngine):
        pause = Engine.pause  # the abstract one

    with pytest.raises(TypeError, match="abstract method.*pause"):
        NoPause(["http://a"])


@pytest.mark.parametrize("overrides, field, capability", ASKING, ids=[f for _, f, _ in ASKING])
def test_a_config_asking_for_a_capability_the_engine_lacks_is_refused_in_one_line(overrides, field, capability):
    run = config(*overrides)
    assert (field, capability) in asked(run)
    with pytest.raises(ConfigError) as refused:
        CoreEngine.check_config(run)
    message = str(refused.value)
    assert "\n" not in message and message.startswith("rollout.engine=core cannot weight_sync.")
    # The first capability asked (the push path) is the one refused; each other alone below.
    first_field, first = asked(run)[0]
    assert message == (f"rollout.engine=core cannot {first_field}: CoreEngine does not implement {first.__name__} "
                       f"({', '.join(sorted(first.__abstractmethods__))})")

    # With every other capability, the one this field asks for is what is refused.
    others = tuple(c for c in (ProcessGroupPush, SharedMemoryPush, DiskLoad, MemoryRelease, SyncProbe)
                   if c is not capability)
    lacking = type("Lacking", (CoreEngine, *others), {})
    with pytest.raises(ConfigError, match=f"^rollout.engine=core cannot {re.escape(field)}: Lacking does not "
                                          f"implement {capability.__name__} \\("):
        lacking.check_config(run)


@pytest.mark.parametrize("method", sorted(PUSH))
def test_the_core_and_one_push_path_is_enough_for_a_config_asking_nothing_else(method):
    """Every training config names a push path (weight_sync.method); nothing else is needed
    unless the config asks for it (colocate, check_every)."""
    run = config(f"weight_sync.method={method}", *(["weight_sync.colocate=true"] if method == "tensor" else []))
    minimal = type("Minimal", (CoreEngine, PUSH[method], *([MemoryRelease] if method == "tensor" else [])), {})
    minimal.check_config(run)  # no error
    assert [capability for _, capability in asked(run)] == [PUSH[method], *([MemoryRelease] if method == "tensor"
                                                                             else [])]


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_both_engines_have_every_capability(name):
    kind = engine_class(name)
    for capability in (ProcessGroupPush, SharedMemoryPush, DiskLoad, MemoryRelease, SyncProbe):
        assert issubclass(kind, capability)
    assert not kind.__abstractmethods__


class OrderedPush(CoreEngine, ProcessGroupPush):
    """The shared send_bucket over a recording engine."""

    def __init__(self, urls):
        super().__init__(urls)
        self.calls = []

    def begin_update(self):
        pass

    def end_update(self, weight_version):
        pass

    def open_weight_group(self, url, name, master_address, backend, timeout_s):
        return f"group-{url}"

    def close_weight_group(self, url, name, group):
        pass

    def post_bucket(self, url, name, bucket):
        self.calls.append(("post", url, name, [n for n, _ in bucket]))

    def broadcast(self, group, flat):
        self.calls.append(("broadcast", group, flat.numel()))


def test_a_bucket_reaches_each_server_in_turn_post_beside_broadcast():
    """A server only ever waits for a sender already broadcasting to it: server a's post and
    broadcast both complete before server b's begin (the post runs on a thread beside it)."""
    engine = OrderedPush(["http://a", "http://b"])
    bucket = [("w", torch.ones(3)), ("v", torch.zeros(2, dtype=torch.bfloat16))]
    flat = engine.pack_bucket(bucket)
    assert flat.dtype == torch.uint8 and flat.numel() == 3 * 4 + 2 * 2
    engine.send_bucket([(url, f"g{i}", f"group-{url}") for i, url in enumerate(engine.urls)], bucket, flat)
    first, second = sorted(engine.calls[:2]), sorted(engine.calls[2:])
    assert first == [("broadcast", "group-http://a", 16), ("post", "http://a", "g0", ["w", "v"])]
    assert second == [("broadcast", "group-http://b", 16), ("post", "http://b", "g1", ["w", "v"])]


class Probe(CoreEngine, SyncProbe):
    """A server whose prefill answers each token's log-prob as -token, dropping the last `short`."""

    def __init__(self, urls, short=0):
        super().__init__(urls)
        self.short = short

    def prefill_logprobs(self, url, sequence):
        return [-float(t) for t in sequence[1:len(sequence) - self.short]]


def test_the_sync_checks_probe_is_one_prefill_per_sequence_each_checked_complete():
    assert Probe(["http://a"]).prompt_logprobs("http://a", [[1, 2, 3], [4, 5]]) == [[-2.0, -3.0], [-5.0]]
    with pytest.raises(WeightSyncError, match=r"^server http://a: 1 prompt log-probs \(0 missing\) for the 2 tokens "
                                              r"after the first of a probe sequence$"):
        Probe(["http://a"], short=1).prompt_logprobs("http://a", [[1, 2, 3]])


def test_gspo_eval_with_running_servers_refuses_an_engine_that_cannot_load_from_disk(tmp_path, monkeypatch, capsys):
    """gspo-eval --urls has the servers load the weights from disk: an engine without DiskLoad is
    refused in one line before anything is loaded (it called load_from_disk unchecked)."""
    from gspo_mcore import engines
    from gspo_mcore.evaluation import cli as evaluate
    from gspo_mcore.common.errors import run_cli

    monkeypatch.setitem(engines.ENGINES, "sglang", f"{__name__}:CoreEngine")  # the config's engine, core only
    code = run_cli(lambda: evaluate.main(["--config", str(REPO / "configs/tiny_cpu.yaml"), "--model",
                                          str(tmp_path / "absent"), "--urls", "http://127.0.0.1:9"]))
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: rollout.engine=core cannot gspo-eval --urls: CoreEngine does not implement DiskLoad "
                   f"({', '.join(sorted(DiskLoad.__abstractmethods__))})"), err
