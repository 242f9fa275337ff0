"""Dynamic sampling in the trainer's rollout source (gspo_mcore.rollout.source.RolloutSource), against a scripted
engine: groups without signal are dropped, and further generation rounds (fresh prompts,
fresh seeds) refill the batch up to `rollout.max_sampling_rounds`."""

import threading
import time

import pytest
import torch

from gspo_mcore.common.seeds import rollout_seed
from gspo_mcore.config import load_config
from gspo_mcore.tasks.toy import make_prompts, make_tokenizer
from helpers import GROUP, source_for


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("task")
    make_tokenizer(root / "tokenizer")
    make_prompts(root / "prompts.jsonl", 400, seed=0)
    return root


def test_rounds_refill_the_batch_with_informative_groups(task):
    source, engine = source_for(task, rollout_batch_size=6, oversample=2.0, max_sampling_rounds=50)
    try:
        rollouts, advantages, metrics = source.collect(step=3, weight_version="step-3")
    finally:
        source.close()
    asked = [c for categories, _ in engine.calls for c in categories[::GROUP]]
    assert len(engine.calls) == metrics["sampling_rounds"] > 1
    assert metrics["groups_kept"] == 6 and metrics["groups_total"] == len(asked)
    # Each round asks oversample x the groups still missing, for fresh prompts.
    missing = 6
    for categories, _ in engine.calls:
        assert len(categories) == 2 * missing * GROUP
        missing -= min(missing, categories[::GROUP].count("color"))
    assert missing == 0
    assert source.sampler.state_dict()["position"] == len(asked)
    # Each response's seed is its prompt's draw and its place in the group's: the rounds continue
    # the draws where the previous one stopped, so no seed repeats within the step.
    seeds = [s for _, round_seeds in engine.calls for s in round_seeds]
    assert seeds == [rollout_seed(1234, draw, k) for draw in range(len(asked)) for k in range(GROUP)]
    assert len(set(seeds)) == len(seeds)
    # Only groups with signal, whole, with group-normalised advantages.
    assert len(rollouts) == 6 * GROUP
    for g in range(6):
        members = rollouts[g * GROUP : (g + 1) * GROUP]
        assert len({tuple(r.prompt_ids) for r in members}) == 1
        assert "color" in source.tokenizer.decode(members[0].prompt_ids)
        group_adv = torch.tensor(advantages[g * GROUP : (g + 1) * GROUP])
        assert group_adv.sum().abs() < 1e-5 and group_adv[0] > 0 > group_adv[1]
    # The reward over everything generated: half of each color group is right.
    assert metrics["reward_mean"] == pytest.approx(asked.count("color") * GROUP / 2 / (len(asked) * GROUP))


def test_rounds_stop_at_the_limit_and_the_step_trains_on_fewer(task):
    source, engine = source_for(task, rollout_batch_size=40, max_sampling_rounds=2)
    try:
        rollouts, _, metrics = source.collect(step=0, weight_version="step-0")
    finally:
        source.close()
    colors = [categories[::GROUP].count("color") for categories, _ in engine.calls]
    assert metrics["sampling_rounds"] == len(engine.calls) == 2
    assert len(engine.calls[1][0]) == (40 - colors[0]) * GROUP
    assert metrics["groups_kept"] == sum(colors) < 40 and len(rollouts) == sum(colors) * GROUP


def test_one_round_without_dropping_keeps_every_group(task):
    source, engine = source_for(task, rollout_batch_size=5, group_filter="all", max_sampling_rounds=3)
    try:
        rollouts, advantages, metrics = source.collect(step=0, weight_version="step-0")
    finally:
        source.close()
    assert len(engine.calls) == metrics["sampling_rounds"] == 1
    assert metrics["groups_kept"] == 5 and len(rollouts) == 5 * GROUP
    assert all(a == 0 for a, r in zip(advantages, rollouts) if "color" not in source.tokenizer.decode(r.prompt_ids))


def test_a_reward_that_takes_the_prompt_and_stop_strings(task):
    """A reward that reads the request from the prompt (not the answer field) scores what the
    toy reward does; rollout.stop goes to the engine with each request."""
    source, engine = source_for(task, "reward.name=tests.reward_fixtures:category_from_prompt", "rollout.stop=[' )']",
                                rollout_batch_size=4, group_filter="all")
    try:
        rollouts, _, metrics = source.collect(step=0, weight_version="step-0")
    finally:
        source.close()
    asked = engine.calls[0][0][::GROUP]
    assert metrics["reward_errors"] == 0
    assert metrics["reward_mean"] == pytest.approx(asked.count("color") * GROUP / 2 / (len(asked) * GROUP))
    assert engine.params[0]["stop"] == [" )"] and engine.params[0]["max_new_tokens"] == 1024


def test_chat_template_kwargs_that_break_the_template_are_named(task):
    from gspo_mcore.common.errors import InputError

    with pytest.raises(InputError, match=r"^data.chat_template_kwargs: the chat template fails on the first record "
                                         r"\(TypeError: .*add_generation_prompt"):
        source_for(task, "data.chat_template_kwargs.add_generation_prompt=false")


def test_max_sampling_rounds_must_be_positive():
    from gspo_mcore.config import ConfigError

    with pytest.raises(ConfigError, match="rollout.max_sampling_rounds: must be >= 1"):
        load_config(None, ["rollout.max_sampling_rounds=0"])


class RecordingControl:

    def __init__(self):
        self.calls = []

    def pause(self, keep_tokens=True):
        self.calls.append(("pause", keep_tokens))

    def resume(self):
        self.calls.append(("continue",))


def _producer_run(task, mode, steps=4, batch=3, staleness=1, delay_s=0.05, update_s=0.1, during_update=None):
    """`during_update`: a list that gets, per engine call, whether it started while the trainer
    updated (counted, not timed)."""
    from gspo_mcore.rollout.producer import build_producer

    source, engine = source_for(task, rollout_batch_size=batch, mode=mode, max_staleness=staleness,
                                max_sampling_rounds=50)
    engine.delay_s = delay_s
    updating = threading.Event()
    if during_update is not None:
        generate = engine.generate

        def counted(*args, **kwargs):
            during_update.append(updating.is_set())
            return generate(*args, **kwargs)

        engine.generate = counted
    control = RecordingControl()
    producer = build_producer(source, control).start(0)
    outstanding, rows = [], []
    try:
        for step in range(steps):
            got = producer.get_batch(step)
            rollouts, advantages, metrics = got.rollouts, got.advantages, got.metrics
            if mode == "async":
                with producer.changed:  # the pacing rule's count against its bound at this version
                    outstanding.append((producer._outstanding(), (staleness + step + 1) * batch))
            rows.append((rollouts, advantages, metrics))
            updating.set()
            time.sleep(update_s)  # the update: generation goes on meanwhile
            producer.pause()
            updating.clear()
            engine.version = step + 1  # the push
            producer.resume(step + 1)
    finally:
        producer.close()
        source.close()
    # Asynchronous producers stop their client: threads waiting on requests return.
    assert engine.closed == (mode != "sync")
    # The servers are paused around each push only when something is in flight (asynchronous modes).
    assert control.calls == ([] if mode == "sync" else [("pause", True), ("continue",)] * steps)
    return rows, outstanding


def _seeded_groups(engine) -> dict:
    """Each group the engine was asked for: its seeds -> its prompt's category."""
    return {tuple(seeds[g:g + GROUP]): categories[g]
            for categories, seeds in engine.calls for g in range(0, len(seeds), GROUP)}


def test_a_sample_draws_the_same_seed_in_every_mode_and_after_a_resume(task):
    """The seed follows the prompt's draw (gspo_mcore.common.seeds.rollout_seed), not the step or
    the order the asynchronous producer's threads run in: each group of an async run is sampled
    with the seeds the sync run gave the same draw, and a source resumed at a position draws on
    from there with the uninterrupted run's seeds."""
    from gspo_mcore.rollout.producer import build_producer

    groups = {}
    for mode in ("sync", "async"):
        source, engine = source_for(task, rollout_batch_size=3, mode=mode, max_staleness=1, max_sampling_rounds=50)
        producer = build_producer(source, RecordingControl()).start(0)
        try:
            for step in range(2):
                producer.get_batch(step)
                producer.pause()
                producer.resume(step + 1)
        finally:
            producer.close()
            source.close()
        groups[mode] = _seeded_groups(engine)
    draws = [tuple(rollout_seed(1234, d, k) for k in range(GROUP)) for d in range(len(groups["sync"]))]
    assert list(groups["sync"]) == draws
    assert set(groups["async"]) <= set(draws + [tuple(rollout_seed(1234, d, k) for k in range(GROUP))
                                                for d in range(len(draws), len(draws) + 20)])
    common = set(groups["sync"]) & set(groups["async"])
    assert len(common) >= 6 and all(groups["sync"][s] == groups["async"][s] for s in common)
    resumed, engine = source_for(task, rollout_batch_size=3)
    resumed.load_state_dict({"sampler": {**resumed.sampler.state_dict(), "position": 5},
                             "running": resumed.running.state_dict()})
    try:
        resumed.collect(step=2)
    finally:
        resumed.close()
    assert engine.calls[0][1][:GROUP] == [rollout_seed(1234, 5, k) for k in range(GROUP)]
    assert _seeded_groups(engine)[draws[5]] == groups["sync"][draws[5]]


def test_engine_idle_fraction_sees_a_synchronous_run_idle_the_engine_while_it_trains(task):
    """sync: the engine works only inside get_batch; the 0.3 s 'update' after each batch is idle
    time (a sixth of each cycle or more here); async keeps it busy. The stand-in takes 0.2 s a
    call, so a batch's generation outlasts the update and the producer's own CPU work weighs
    little beside it: at 0.05 s a call and a 0.1 s update, under load (beside the code reward's
    tests), async once read idle 0.83 and 0.63 against sync's 0.35 and 0.29. With eight busy
    processes beside it now: async <= 0.01, sync >= 0.2."""
    calls = {"sync": [], "async": []}
    runs = {mode: _producer_run(task, mode, steps=3, delay_s=0.2, update_s=0.3, during_update=calls[mode])[0]
            for mode in ("sync", "async")}
    idle = {mode: [m["engine_idle_fraction"] for _, _, m in rows[1:]] for mode, rows in runs.items()}
    # What is counted, not the shared machine's clock: a sync run asks nothing of the engine while
    # it updates, an async one does; the idle fraction is measured, in [0, 1], and sync's is not 0.
    assert calls["sync"] and not any(calls["sync"]) and any(calls["async"]), calls
    assert all(0 < f <= 1 for f in idle["sync"]) and all(0 <= f <= 1 for f in idle["async"]), idle
    assert all(m["tokens_regenerated"] == 0 for _, _, m in _producer_run(task, "sync", steps=1)[0])


@pytest.mark.parametrize("mode", ["one_step_off", "async"])
def test_asynchronous_producers_keep_the_staleness_bound_and_full_batches(task, mode):
    rows, outstanding = _producer_run(task, mode)
    for step, (rollouts, advantages, metrics) in enumerate(rows):
        assert len(rollouts) == 3 * GROUP and len(advantages) == len(rollouts)  # full batches of informative groups
        assert metrics["groups_kept"] == 3 and 0 <= metrics["staleness_max"] <= 1
        assert all(step - r.oldest_version <= 1 for r in rollouts)
    # Generation overlapped the updates: later batches hold tokens of the previous version.
    assert any(metrics["staleness_max"] == 1 for _, _, metrics in rows[1:])
    # Pacing: groups accepted or running never exceed (max_staleness + version + 1) batches; groups
    # without signal are replaced (dynamic sampling), not counted.
    assert all(count <= bound for count, bound in outstanding), outstanding


def test_async_pacing_does_not_depend_on_when_a_groups_callback_runs(task, monkeypatch):
    """A future is done before its done-callbacks run: the producer once read "kept" from a flag
    its callback set, so a group taken in between went uncounted and one group too many was
    admitted (CI: staleness 2 under max_staleness 1). Callbacks delayed here make that window wide."""
    from gspo_mcore.rollout import producer

    finished = producer.AsyncProducer._finished

    def late(self, *args):
        time.sleep(0.2)
        finished(self, *args)

    monkeypatch.setattr(producer.AsyncProducer, "_finished", late)
    rows, outstanding = _producer_run(task, "async", steps=5)
    assert all(m["staleness_max"] <= 1 for _, _, m in rows), [m["staleness_max"] for _, _, m in rows]
    assert all(count <= bound for count, bound in outstanding), outstanding


def test_a_reward_that_always_raises_stops_the_run_quoting_it(task, tmp_path):
    """It scored 0 on every call and the run looked like a run (exit 0, reward 0.000, the
    exception's text nowhere)."""
    from gspo_mcore.common.errors import InputError

    source, _ = source_for(task, "reward.name=tests.reward_fixtures:always_raises", rollout_batch_size=2)
    source.error_log = tmp_path / "logs" / "reward_errors.log"
    try:
        with pytest.raises(InputError, match=r"^reward tests.reward_fixtures:always_raises: 8 of 8 calls failed "
                                             r"\(reward.max_error_fraction 0.5\); the first: response 0: RuntimeError: "
                                             r"this reward never works; all in .*reward_errors.log$"):
            source.collect(0)
    finally:
        source.close()
    lines = source.error_log.read_text().splitlines()
    assert len(lines) == 8 and all("RuntimeError: this reward never works" in line for line in lines)


def test_reward_failures_under_the_bound_are_logged_and_the_round_goes_on(task, tmp_path):
    from gspo_mcore.common.errors import InputError
    from gspo_mcore.rewards.runner import RewardStats

    source, _ = source_for(task, "reward.max_error_fraction=0.25")
    source.error_log = tmp_path / "reward_errors.log"
    try:
        source._check_rewards(RewardStats(errors=1, timeouts=1, messages=["response 3: ValueError: x",
                                                                         "response 5: timed out after 10 s"]), 8)
        assert source.error_log.read_text().splitlines() == [
            "reward gspo_mcore.tasks.toy:category_reward: response 3: ValueError: x",
            "reward gspo_mcore.tasks.toy:category_reward: response 5: timed out after 10 s"]
        with pytest.raises(InputError, match="3 of 8 calls failed .*the first: response 0: KeyError: 'k'"):
            source._check_rewards(RewardStats(errors=3, messages=["response 0: KeyError: 'k'"] * 3), 8)
    finally:
        source.close()


def test_closing_the_source_while_a_group_thread_scores_waits_for_it_and_leaves_no_worker(task):
    """An asynchronous producer's close does not wait for its group threads: the source's close
    killed the reward workers of a group mid-score, closed their pipes as it wrote (CI, fast tier:
    `ValueError: PyMemoryView_FromBuffer(): info->buf must not be NULL` from kill_worker) and the
    scoring thread started a new worker for the dead one, which nothing stopped."""
    import threading

    source, _ = source_for(task, "reward.name=tests.reward_fixtures:slow_reward", rollout_batch_size=1)
    outcome = {}

    def score():
        try:
            outcome["round"] = source.round(1, 1)
        except Exception as exc:  # noqa: BLE001 - what a closing run's group thread meets
            outcome["error"] = exc

    thread = threading.Thread(target=score)
    thread.start()
    deadline = time.monotonic() + 30
    while not any(w.busy_with is not None for w in source.rewards._pool) and time.monotonic() < deadline:
        time.sleep(0.01)
    workers = [w.process for w in source.rewards._pool]
    assert workers, "the round never reached its reward"
    source.close()  # waits for the score in flight, then kills its workers
    thread.join(30)
    assert "round" in outcome, outcome  # the score in flight finished
    assert source.rewards._pool == [] and all(p.poll() is not None for p in workers)
    with pytest.raises(RuntimeError, match="scored after its runner was closed"):
        source.rewards.score(["a"], ["b"])


def test_a_rewards_reasons_reach_the_rollouts_and_the_samples_file(task, tmp_path):
    """A code score of 0 said nothing in samples/step_N.jsonl (reward only): the reward's
    reward_reasons hook (the code reward's first failing test) now travels with each reply, onto
    the rollout, into the file; a response that scored says nothing."""
    import json

    from gspo_mcore.run.sample_log import write_samples

    source, _ = source_for(task, "reward.name=tests.reward_fixtures:category_saying_why", rollout_batch_size=2,
                          max_sampling_rounds=50)
    try:
        rollouts, _, _ = source.collect(step=0)
    finally:
        source.close()
    assert {r.reward for r in rollouts} == {0.0, 1.0}
    for r in rollouts:
        first = source.tokenizer.decode(r.response_ids, skip_special_tokens=True).split()[:1]
        assert r.reward_reason == (None if r.reward else f"not a color: {first}")
    write_samples(tmp_path / "step_1.jsonl", source.tokenizer, rollouts, [])
    rows = [json.loads(line) for line in (tmp_path / "step_1.jsonl").read_text().splitlines()]
    assert [row.get("reason") for row in rows] == [r.reward_reason for r in rollouts]
    assert all(("reason" in row) == (row["reward"] == 0) for row in rows)
