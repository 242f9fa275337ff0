"""Exactness that cannot slip silently: the strict check (gspo_mcore.run.exactness) on the batch's
fresh tokens, its evidence, when it is on, and every SGLang answer a push's exactness rests on
checked against a stand-in that answers as SGLang 0.5.23 does (entrypoints/http_server.py)."""

import json
import math
import random

import pytest
import torch

from gspo_mcore.config import load_config
from gspo_mcore.engines.sglang.engine import SGLangEngine
from gspo_mcore.common.errors import WeightSyncError
from gspo_mcore.run.exactness import ExactnessError, check, mismatches, sequence_mismatch
from gspo_mcore.gspo.loss import sequence_log_ratio
from gspo_mcore.batch.rollout import Batch, Rollout
from helpers import REPO, ToyHandler, toy_server, url
from gspo_mcore.batch.trajectory import Trajectory, to_rollout


def _rollout(n, rng, origin=("http://s:1 rid=a",), versions=(), mask=()):
    logprobs = [-rng.uniform(0.1, 3.0) for _ in range(n)]
    return Rollout(list(range(1, 5)), list(range(10, 10 + n)), logprobs, "stop", "step-3", None, tuple(versions),
                   tuple(mask), origin=origin)


def test_sequence_mismatch_is_eq7_as_the_loss_computes_it():
    rng = random.Random(0)
    engine = [[-rng.uniform(0, 4) for _ in range(9)] for _ in range(5)]
    trainer = [[e + rng.gauss(0, 1e-3) for e in row] for row in engine]
    mask = [[float(rng.random() < 0.7) for _ in range(9)] for _ in range(5)]
    mask[0] = [0.0] * 9  # no token: 0
    expected = sequence_log_ratio(torch.tensor(trainer, dtype=torch.float64), torch.tensor(engine, dtype=torch.float64),
                                  torch.tensor(mask, dtype=torch.float64)).abs()
    for i in range(5):
        assert sequence_mismatch(engine[i], trainer[i], mask[i]) == pytest.approx(float(expected[i]), abs=1e-15)


def test_only_fresh_model_tokens_count_and_nan_never_passes():
    """An environment's tokens (loss mask 0) and an older version's tokens (stale) carry gaps that
    are not the engine's to answer for; a gap on a fresh token is; NaN fails whatever the tolerance."""
    rng = random.Random(1)
    env = _rollout(6, rng, mask=(1, 1, 0, 0, 1, 1))
    old = _rollout(6, rng, versions=(2, 2, 2, 3, 3, 3))
    fresh = _rollout(6, rng)
    trainer = [list(r.logprobs) for r in (env, old, fresh)]
    trainer[0][2] += 5.0  # an environment token: its engine "log-prob" is 0, never compared
    trainer[1][0] += 5.0  # a stale token (step-2 weights): the policy moved since
    batch = Batch.spanning([env, old, fresh], [0.0] * 3, {}, 3)
    largest, found = mismatches(batch.rollouts, trainer, batch.stale, 1e-4)
    assert found == [] and largest == 0.0
    trainer[2][4] += 5.9e-4  # one fresh token off by 5.9e-4 in 6: |log s| just under 1e-4
    assert mismatches(batch.rollouts, trainer, batch.stale, 1e-4)[1] == []
    trainer[2][4] += 1.1e-4
    (m,) = mismatches(batch.rollouts, trainer, batch.stale, 1e-4)[1]
    assert (m.index, m.worst_token) == (2, 4) and m.abs_log_ratio == pytest.approx(7e-4 / 6)
    trainer[1][5] = math.nan  # a fresh token of the spanning response
    largest, found = mismatches(batch.rollouts, trainer, batch.stale, 1e3)
    assert [m.index for m in found] == [1] and math.isnan(largest)


def test_a_failed_check_writes_its_evidence_whole_and_names_it(tmp_path):
    rng = random.Random(2)
    rollouts = [_rollout(rng.randint(3, 12), rng, origin=(f"http://s:{i} rid=r{i}", f"http://s:{i} rid=t{i}"))
                for i in range(8)]
    trainer = [list(r.logprobs) for r in rollouts]
    assert check(rollouts, trainer, None, step=4, version="step-4", tolerance=1e-4, log_dir=tmp_path) == 0.0
    trainer[5][1] += 0.4
    trainer[6][0] += 0.01
    with pytest.raises(ExactnessError) as err:
        check(rollouts, trainer, None, step=4, version="step-4", tolerance=1e-4, log_dir=tmp_path / "logs")
    message = str(err.value)
    path = tmp_path / "logs" / "exactness_step_000005.json"
    assert "\n" not in message and "step 5: 2 of 8 sequences" in message and str(path) in message
    assert "http://s:5 rid=r5, http://s:5 rid=t5" in message and "token 1 off by 0.4" in message
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left
    evidence = json.loads(path.read_text())
    assert evidence["step"] == 5 and evidence["trained_version"] == "step-4" and evidence["batch_size"] == 8
    worst, second = evidence["sequences"]
    assert worst["index"] == 5 and worst["requests"] == ["http://s:5 rid=r5", "http://s:5 rid=t5"]
    for key in ("prompt_ids", "response_ids", "loss_mask", "token_versions", "stale", "engine_logprobs",
                "trainer_logprobs", "finish_reason", "weight_version", "abs_log_ratio", "worst_token",
                "engine_routed_experts"):
        assert key in worst
    assert worst["engine_logprobs"] == rollouts[5].logprobs and worst["trainer_logprobs"] == trainer[5]
    # A rank that does not write names the same file and writes nothing.
    with pytest.raises(ExactnessError, match="exactness_step_000005.json"):
        check(rollouts, trainer, None, step=4, version="step-4", tolerance=1e-4, log_dir=tmp_path / "r1", write=False)
    assert not (tmp_path / "r1").exists()


def test_a_trajectory_names_every_request_it_came_from():
    rng = random.Random(3)
    trajectory = Trajectory([1, 2])
    trajectory.add_model(_rollout(3, rng, origin=("http://a rid=1",)))
    trajectory.add_environment([7, 8])
    trajectory.add_model(_rollout(2, rng, origin=("http://b rid=2",)))
    assert to_rollout(trajectory).origin == ("http://a rid=1", "http://b rid=2")


@pytest.mark.parametrize("overrides, on", [
    ([], True),  # tiny_cpu: float32 trainer and engine
    (["rollout.engine_dtype=bfloat16"], False),
    (["model.dtype=bfloat16"], False),
    (["rollout.engine_dtype=bfloat16", "train.strict_exactness=true"], True),
    (["train.strict_exactness=false"], False),
])
def test_strict_is_on_where_both_sides_compute_in_float32(overrides, on):
    assert load_config("configs/tiny_cpu.yaml", overrides).strict is on


def test_strict_exactness_reads_yaml_booleans_and_refuses_others(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("base: " + str((REPO / "configs" / "tiny_cpu.yaml").resolve()) +
                      "\ntrain: {strict_exactness: true}\n")
    assert load_config(config).train.strict_exactness == "true"
    with pytest.raises(Exception, match="train.strict_exactness: 'sometimes' is not one of"):
        load_config("configs/tiny_cpu.yaml", ["train.strict_exactness=sometimes"])
    with pytest.raises(Exception, match="train.strict_exactness_tolerance: must be > 0"):
        load_config("configs/tiny_cpu.yaml", ["train.strict_exactness_tolerance=0"])


# ------------------------------------------------------------ SGLang's answers, checked
class SGLang(ToyHandler):
    """The control routes of SGLang 0.5.23 as entrypoints/http_server.py answers them; `refuse`
    makes one route answer what a refusing server does."""
    refuse: dict = {}
    version = "default"

    def do_POST(self):
        body = self.body()
        if self.path in self.refuse:
            code, answer = self.refuse[self.path]
            return self.text(code, answer) if isinstance(answer, str) else self.json(code, answer)
        if self.path in ("/pause_generation", "/continue_generation"):
            verb = "paused" if self.path == "/pause_generation" else "continued"
            return self.json(200, {"message": f"Generation {verb} successfully.", "status": "ok"})
        if self.path == "/end_weight_update":
            return self.json(200, {"success": True, "message": "Success."})
        if self.path == "/update_weight_version":
            type(self).version = body["new_version"]
            return self.json(200, {"success": True, "message": f"Weight version updated to {body['new_version']}",
                                    "new_version": body["new_version"]})
        if self.path == "/flush_cache":
            return self.text(200, "Cache flushed.\nPlease check backend logs for more details. (When there are "
                                   "running or waiting requests, the operation will not be performed.)\n")
        self.json(404, {"detail": "Not Found"})


@pytest.fixture
def sglang():
    with toy_server(type("Handler", (SGLang,), {"refuse": {}})) as one, \
            toy_server(type("Handler", (SGLang,), {"refuse": {}})) as two:
        yield [one, two]


def test_sglang_answers_that_grant_exactness_pass(sglang):
    engine = SGLangEngine([url(s) for s in sglang], timeout_s=5)
    engine.pause(keep_tokens=True)
    engine.end_update("step-4")
    engine.resume()
    assert [s.RequestHandlerClass.version for s in sglang] == ["step-4", "step-4"]


@pytest.mark.parametrize("route, refusal, expected", [
    # A flush refused for pending requests: 400 with the scheduler's message.
    ("/flush_cache", (400, "Flush cache failed.\n"), "HTTP 400: Flush cache failed."),
    # Any 200 that does not say the cache was flushed.
    ("/flush_cache", (200, "Cache not flushed because there are pending requests.\n"), "expected 'Cache flushed'"),
    ("/update_weight_version", (200, {"success": True, "new_version": "step-3"}),
     "expected success true and new_version 'step-4'"),
    ("/update_weight_version", (400, {"success": False, "message": "Failed to update weight version: boom"}),
     "Failed to update weight version: boom"),
    ("/update_weight_version", (200, {"message": "ok"}), "expected success true"),
    ("/end_weight_update", (200, {"message": "closed"}), "expected success true"),
])
def test_a_refused_push_step_names_the_server_and_its_answer(sglang, route, refusal, expected):
    sglang[1].RequestHandlerClass.refuse[route] = refusal
    engine = SGLangEngine([url(s) for s in sglang], timeout_s=5)
    with pytest.raises(WeightSyncError, match=f"^server {url(sglang[1])}{route}: .*{expected}"):
        engine.end_update("step-4")


@pytest.mark.parametrize("call, route", [("pause", "/pause_generation"), ("resume", "/continue_generation")])
def test_a_pause_or_continue_not_acknowledged_stops_the_push(sglang, call, route):
    sglang[0].RequestHandlerClass.refuse[route] = (200, {"message": "Generation paused successfully."})
    engine = SGLangEngine([url(s) for s in sglang], timeout_s=5)
    with pytest.raises(WeightSyncError, match=f"^server {url(sglang[0])}{route}: expected status ok"):
        getattr(engine, call)()


def test_each_sglang_response_names_its_server_and_the_request_id_it_was_sent_with():
    """The id the client sends (`rid`, fresh per attempt) is what the server logs it by; the
    rollout carries it with the server and SGLang's retraction and prefix-cache counts."""
    from gspo_mcore.engines.sglang.client import SGLangClient

    fixture = json.loads((REPO / "tests" / "fixtures" / "sglang_0.5.23_generate.json").read_text())
    seen = []

    class Generate(SGLang):
        def do_POST(self):
            body = self.body()
            if self.path != "/generate":  # the close's /abort_request
                return self.json(200, {})
            seen.append(body["rid"])
            answer = fixture["response"][0] if isinstance(fixture["response"], list) else fixture["response"]
            self.json(200, answer)

    with toy_server(Generate) as server:
        client = SGLangClient([url(server)], 256)
        prompt = fixture["request"]["input_ids"]
        rollouts = client.generate([prompt, prompt], {"max_new_tokens": 5, "temperature": 1.0})
        client.close()
    assert len(set(seen)) == 2 and all(len(rid) == 32 for rid in seen)
    origins = sorted(r.origin[0] for r in rollouts)
    assert origins == sorted(f"{url(server)} rid={rid} retractions=0 cached_tokens=3" for rid in seen)
