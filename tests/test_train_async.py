"""Asynchronous GSPO end to end on CPU: generation overlapping training against real SGLang
servers (two of them), both modes under 1 rank, DP2 and EP2 (one of them multi-turn, with the
engine's routed experts), the staleness bound held and reported every step, and an asynchronous
run killed (SIGKILL) with groups in flight (nothing of it left), then resumed."""

import pytest

from helpers import descendants, kill_and_reap, metrics, reaped, start, toy_overrides, train, train_command, wait_for_rows

# Starts torchrun and SGLang servers; the module's runs share two servers (each run pushes its
# own weights first), so they stay on one worker.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("async_train")]

COMMON = ["reward.norm=group", "train.export_hf=false", "weight_sync.check_every=2"]


@pytest.fixture(scope="module")
def servers(toy, tmp_path_factory):
    """Two float32 servers of the toy model, started at once."""
    from contextlib import ExitStack

    from gspo_mcore.common.netaddr import free_port
    from gspo_mcore.common.processes import ManagedServer
    from gspo_mcore.engines.sglang.server import sglang_command
    from gspo_mcore.engines.sglang.sglang_cpu import server_env

    logs = tmp_path_factory.mktemp("async_servers")
    with ExitStack() as stack:
        started = []
        for i in range(2):
            port = free_port()
            cmd = sglang_command(str(toy / "model"), port, dtype="float32", max_running_requests=128,
                                 extra_args=("--disable-radix-cache", "--enable-return-routed-experts"))
            server = ManagedServer(cmd, f"http://127.0.0.1:{port}", logs / f"sglang_{i}.log", env=server_env())
            stack.callback(server.stop)
            started.append(server.launch())
        yield f"rollout.urls=[{','.join(s.ready().url for s in started)}]"


# A user's rollout function by name: three model turns, user messages spliced in between. Three
# steps: with one rank a step trains in about a second, and on a loaded machine a batch's first
# turns can miss that window once (all its tokens then come after the push: nothing stale).
# Strict exactness off: a multi-turn step was once stopped by one token of one 25-token sequence
# (trainer -5.670, engine -5.508; every other token within 1e-6: a float32 router near-tie picking
# another expert, the suspicion; the session note of 2026-11-26, fourth session). This run tests
# staleness and routing delivery; exactness has its own tests (test_exactness.py, test_train_engine.py).
MULTI_TURN = ["rollout.function=tests.rollout_fixtures:three_turns", "rollout.return_routed_experts=true",
              "train.steps=3", "train.strict_exactness=false"]


@pytest.mark.parametrize("mode, nproc, options", [
    ("async", 2, ["distributed.expert_parallel=2"]),
    ("one_step_off", 2, ["loss.proximal=first_minibatch"]),  # DP2
    # Not run (the suite's time budget): one_step_off under EP2 and async under DP2. The modes
    # differ on rank 0's producer only, which the layout does not reach: async-EP2 covers the
    # async producer over two ranks, one_step_off-DP2 the DP2 layout under a producer.
    ("one_step_off", 1, MULTI_TURN),
], ids=["async-EP2", "one_step_off-DP2-free-prox", "one_step_off-1-multi-turn"])
def test_asynchronous_modes_train_with_bounded_staleness(toy, servers, tmp_path, mode, nproc, options):
    """Two servers: full batches, every step's staleness within rollout.max_staleness (a
    trajectory counts its oldest model token), the trainer not waiting once generation runs
    ahead, weights checked; pi_prox recomputed or free from the first minibatch."""
    out = tmp_path / "run"
    train(out, [*toy_overrides(toy), servers, *COMMON, f"rollout.mode={mode}", "train.steps=2", "train.save_every=0",
                 *options], nproc=nproc)
    rows = metrics(out)
    if options == MULTI_TURN:
        assert all(r["turns_mean"] == 3 and 0 < r["env_token_fraction"] < 1 for r in rows)
        # float32 on both sides: the engine's routing of every segment is the trainer's router's
        # wherever the trainer's weights routed it (a response's routing is its last token's
        # version). Responses older weights routed are compared apart: they differ by the
        # policy's change too (25% of a step's pairs once, when both were counted together).
        measured = [r for r in rows if r["routing_mismatch_fraction"] is not None]
        assert rows[0] in measured and all(r["routing_mismatch_fraction"] < 0.02 for r in measured), rows
        assert rows[0]["routing_mismatch_fraction_older"] is None  # step 1: nothing older exists
        older = [r for r in rows if r["routing_mismatch_fraction_older"] is not None]
        assert all(r["routing_mismatch_fraction_older"] > 0.02 for r in older), rows
    assert [r["step"] for r in rows] == ([1, 2, 3] if options == MULTI_TURN else [1, 2])
    for r in rows:
        # async refills continuously; one_step_off keeps sync's rounds (rollout.max_sampling_rounds: 1 here)
        assert r["samples"] == 8 * r["groups_kept"] and (mode != "async" or r["groups_kept"] == 16)
        assert 0 <= r["staleness_max"] <= 1 and r["engine_pause_s"] > 0
        assert 0 <= r["trainer_idle_fraction"] <= 1 and r["behavior_weight_mean"] > 0
    assert any(r["staleness_max"] == 1 for r in rows[1:])  # generation overlapped an update
    assert [r["sync_check_median"] < 1e-4 for r in rows if "sync_check_median" in r] == [True]


def test_an_async_run_killed_with_groups_in_flight_leaves_nothing_and_resumes(toy, servers, tmp_path):
    """SIGKILL mid-run, after checkpoints, groups in flight: the run's own SGLang server (its
    own process group: the kernel's parent-death signal), its reward workers (started by
    producer threads: they watch their parent) and Megatron's checkpoint-writer queue go; then
    --resume (on the module's servers, an applied change) continues from the last checkpoint,
    the in-flight groups dropped and their prompts admitted again in order."""
    out = tmp_path / "run"
    common = [*toy_overrides(toy), "rollout.mode=async", "reward.norm=group", "train.export_hf=false",
              "train.save_every=1", "reward.workers=2"]
    log = tmp_path / "killed.log"
    with reaped(start(train_command(out, [*common, "train.steps=50"]), log)) as proc:
        wait_for_rows(proc, out, 3, log)
        children = descendants(proc)
        assert len(children) >= 5  # the server and its scheduler and detokenizer, the reward workers, ...
        kill_and_reap(proc, children=children)
    saved = int((out / "checkpoints" / "latest").read_text().strip().removeprefix("step_"))
    train(out, [*common, servers, f"train.steps={saved + 2}"], extra=["--resume"])
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(1, saved + 3))  # steps after the checkpoint trained again
    assert all(r["staleness_max"] <= 1 for r in rows)


def test_async_keeps_no_more_requests_in_flight_than_the_server_runs(toy, tmp_path):
    """More responses wanted (4 groups x 8) than the server runs at once (16 running, KV room
    for fewer), a short request timeout, the sync check every step: the client sends no more than
    the KV cache holds (one slot kept for the check), so nothing waits behind a full queue and no
    request is sent again. (It kept max_running_requests in flight whatever the KV room.)
    Strict exactness off, as MULTI_TURN's: CI-like, one of 128 on-policy float32 sequences was once
    stopped at one token (engine -3.9604, trainer -3.9343; the 13 before it within 1e-6, the two
    after off by 7e-4 and 9e-5: the shape of a router near-tie, 2026-11-28). This run tests the
    in-flight bound; exactness has its own tests."""
    import re

    out = tmp_path / "run"
    proc = train(out, [*toy_overrides(toy), "rollout.mode=async", "rollout.num_servers=1",
                        "rollout.max_running_requests=16", "rollout.max_total_tokens=256", "rollout.max_new_tokens=16",
                        "rollout.request_timeout_s=30", "weight_sync.check_every=1", "train.steps=3",
                        # 4 groups, not the config's 16 (42 -> 31 s of CPU): 32 responses, still
                        # several times what 256 tokens of KV room run at once
                        "train.rollout_batch_size=4",
                        "train.save_every=0", "train.export_hf=false", "reward.norm=group",
                        "train.strict_exactness=false"])
    said = re.search(r"rollout: up to (\d+) requests in flight \((\d+) the servers run at once with KV room for "
                     r"(\d+) tokens each", proc.stdout)
    assert said, proc.stdout[-2000:]
    in_flight, running, tokens = map(int, said.groups())
    assert running <= 256 // tokens < 16 and in_flight == max(1, running - 1)
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["requests_retried"] == 0 and r["tokens_regenerated"] == 0 for r in rows)
    assert all(r["sync_check_median"] is not None for r in rows)  # the check ran every step
    assert all(r["staleness_max"] <= 1 and r["groups_kept"] == 4 for r in rows)
