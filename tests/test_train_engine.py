"""The trainer against its engine: routing compared with the engine's and replayed, the trainer
killed (SIGTERM, SIGKILL) with its servers and reward workers, the engine gone for good.
Each test starts its own server, so the tests spread over `make test`'s workers."""

import json
import subprocess

import pytest

from helpers import captured, metrics, reaped, start, toy_overrides, train, train_command, wait_for_rows

pytestmark = pytest.mark.slow  # starts torchrun and SGLang servers


@pytest.fixture(scope="module")
def bf16_server(toy, tmp_path_factory):
    """A bf16 engine of the toy model that returns each token's routed experts."""
    from gspo_mcore.common.netaddr import free_port
    from gspo_mcore.common.processes import ManagedServer
    from gspo_mcore.engines.sglang.server import sglang_command
    from gspo_mcore.engines.sglang.sglang_cpu import server_env

    port = free_port()
    cmd = sglang_command(str(toy / "model"), port, dtype="bfloat16", max_running_requests=128,
                         extra_args=("--disable-radix-cache", "--enable-return-routed-experts"))
    with ManagedServer(cmd, f"http://127.0.0.1:{port}", tmp_path_factory.mktemp("bf16") / "sglang.log",
                       env=server_env()) as managed:
        yield managed.url


@pytest.mark.xdist_group("bf16_server")
def test_strict_exactness_stops_a_bf16_engine_run_with_its_evidence(toy, bf16_server, tmp_path):
    """train.strict_exactness forced on with a bf16 engine (its mismatch ~1e-3 per sequence, past
    the 1e-4 tolerance): the first step stops the run before its update, with one line (exit 3,
    no traceback) naming the step, the worst sequence's requests and the evidence file, which
    holds every offending sequence's tokens, both sides' log-probs and requests."""
    out = tmp_path / "run"
    proc = captured(train_command(out, [*toy_overrides(toy), f"rollout.urls=[{bf16_server}]",
                                        "rollout.engine_dtype=bfloat16", "train.strict_exactness=true",
                                        "train.steps=2", "train.save_every=0", "weight_sync.check_every=0"]))
    assert proc.returncode == 3, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    evidence = out / "logs" / "exactness_step_000001.json"
    assert last.startswith("error: strict exactness") and "step 1:" in last and str(evidence) in last, last
    assert f"from {bf16_server} rid=" in last and "Traceback" not in proc.stderr
    found = json.loads(evidence.read_text())
    assert found["step"] == 1 and found["trained_version"] == "step-0" and found["sequences"]
    for seq in found["sequences"]:
        assert seq["abs_log_ratio"] > 1e-4 and len(seq["requests"]) == 1 and seq["requests"][0].startswith(bf16_server)
        assert len(seq["engine_logprobs"]) == len(seq["trainer_logprobs"]) == len(seq["response_ids"])
    assert not (out / "checkpoints").exists()  # stopped before any update


@pytest.mark.xdist_group("bf16_server")
def test_engine_routing_compared_and_replayed(toy, bf16_server, tmp_path):
    """A bf16 engine returns each token's routed experts. Compared with the trainer's free router
    on the first minibatch (TP=2 + sequence parallel: each rank compares its slice of the
    sequence), a few (token, layer) pairs differ: bf16 rounding flips near-ties, a wrong token
    order would differ almost everywhere. Replayed (EP=2), the routers take the engine's choice:
    none differ. The free run also sizes its later minibatches' band from the mismatch it
    measured on the first (loss.band_from_mismatch), which a bf16 engine puts far above 4e-4."""
    common = [*toy_overrides(toy), "rollout.return_routed_experts=true", "train.steps=1", "train.save_every=0",
              "train.export_hf=false", "weight_sync.check_every=0", f"rollout.urls=[{bf16_server}]",
              "rollout.engine_dtype=bfloat16"]
    train(tmp_path / "free", [*common, "distributed.tensor_parallel=2",
                               "loss.on_policy_first_minibatch=true", "loss.band_from_mismatch=2"], nproc=2)
    train(tmp_path / "replay", [*common, "distributed.expert_parallel=2", "train.routing_replay=true"], nproc=2)
    # Each stage gets its own layers' routing only (gspo_mcore.megatron.routing_delivery): replayed
    # at the wrong layer, the second stage's routers would differ from the engine's.
    train(tmp_path / "replay_pp", [*common, "distributed.pipeline_parallel=2", "train.routing_replay=true"], nproc=2)
    free, replay, replay_pp = (metrics(tmp_path / name) for name in ("free", "replay", "replay_pp"))
    assert all(len(r["routing_mismatch_fraction_per_layer"]) == 4 for r in free + replay + replay_pp)
    assert 0 < sum(r["routing_mismatch_fraction"] for r in free) / len(free) < 0.2
    assert all(r["routing_mismatch_fraction"] == 0 for r in replay + replay_pp)
    # Per sequence trained (each run keeps the groups its own rewards leave varied: one kept 104
    # sequences where the others kept 128, and unnormalised its share looked like 0.61): every rank
    # reads every rollout under TP. Under PP 2 each stage reads its 2 of the 4 layers: half. Under
    # EP (DP 2) each rank its data shards' rollouts, split by tokens over few groups: less than
    # all, once as much as 89% (the exact shares are tests/test_routing_delivery.py's).
    def per_sequence(row):
        return row["routing_mb_per_rank_max"] / row["num_sequences"]

    for free_row, ep_row, pp_row in zip(free, replay, replay_pp):
        assert 0 < per_sequence(ep_row) < per_sequence(free_row)
        assert 0 < per_sequence(pp_row) < 0.6 * per_sequence(free_row)
    for r in free:  # minibatches 2..4 clip at 2 x the mismatch minibatch 1 measured (mean over sequences)
        expected = max(0.0004, 2 * r["mismatch_abs_log_ratio_mean"])
        assert r["clip_band_high"] == pytest.approx(expected, rel=1e-9) and r["clip_band_high"] > 0.001


def test_an_engine_gone_for_good_stops_the_run_with_one_line(toy, tmp_path):
    """The server dies for good mid-run: the run says which server, what failed and where
    --resume continues, in one line, and exits 3 (an engine error, not bad input; no traceback).
    A stopped server refuses connections at once: the request timeout only has to outlast a slow
    live server (10 s timed out step 1 on a loaded machine)."""
    from gspo_mcore.common.netaddr import free_port
    from gspo_mcore.common.processes import ManagedServer
    from gspo_mcore.engines.sglang.server import sglang_command
    from gspo_mcore.engines.sglang.sglang_cpu import server_env

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = sglang_command(str(toy / "model"), port, dtype="float32", max_running_requests=128,
                         extra_args=("--disable-radix-cache",))
    out = tmp_path / "run"
    with ManagedServer(cmd, url, tmp_path / "sglang.log", env=server_env()) as server:
        proc = start(train_command(out, [*toy_overrides(toy), f"rollout.urls=[{url}]", "train.steps=200",
                                         "train.save_every=1", "rollout.max_attempts=2",
                                         "rollout.request_timeout_s=120", "weight_sync.check_every=0"]),
                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        with reaped(proc):
            wait_for_rows(proc, out, 2, timeout_s=300)
            server.stop()
            _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 3, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and url in last and "--resume continues from step_" in last, last
    assert "Traceback" not in stderr


def test_real_shaped_run_ep2_two_bf16_servers_uneven_lengths_save_and_prune(toy, tmp_path):
    """The workload shape that hung or went unchecked before: prompts of 1 to 14 filler words and
    responses up to 24 tokens packed by a 48-token budget (data-parallel ranks get unequal
    natural microbatch counts: an EP all-to-all hang without fillers), EP=2 over 2 ranks, two bf16
    servers the run starts (the sync check probes both), a checkpoint every step with only the
    newest two kept."""
    import random

    rng = random.Random(5)
    prompts = tmp_path / "uneven.jsonl"
    with open(prompts, "w") as f:
        for _ in range(200):
            category = rng.choice(["color", "animal", "fruit", "number"])
            fillers = " ".join(f"{rng.choice(['color', 'fruit'])}_{rng.randrange(60)}" for _ in range(rng.randint(1, 14)))
            article = "an" if category == "animal" else "a"
            f.write(json.dumps({"prompt": f"name {article} {category} ( {fillers} )", "answer": category}) + "\n")
    out = tmp_path / "run"
    train(out, [f"model.hf_dir={toy / 'model'}", f"data.path={prompts}", "eval.datasets=[]", "distributed.expert_parallel=2",
                 "rollout.num_servers=2", "rollout.engine_dtype=bfloat16", "rollout.max_new_tokens=24",
                 "train.max_tokens_per_microbatch=48", "train.steps=3", "train.save_every=1", "train.keep_checkpoints=2",
                 "weight_sync.check_every=1", "train.export_hf=false"],
           nproc=2, timeout=900)
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    # bf16 engine vs float32 trainer, scored on the probes' response tokens under the bf16 default
    # tolerance (0.2; with every probe token, prompts of random filler words gave medians ~0.1 and the
    # old 0.03 stopped such runs); pushed-but-wrong or stale weights differ by ~1.
    assert all(r["sync_check_median"] < 0.2 for r in rows)
    assert any(r["response_length_mean"] < r["response_length_max"] for r in rows), rows  # some stop early
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_000002", "step_000003"]
    assert len(list((out / "logs").glob("sglang_*.log"))) == 2
