"""Score responses in worker processes with a time limit per call (a response; a group when
the reward is batched).

A reward that raises or runs past the limit scores 0 and is counted: math checkers can hang
on adversarial output, and a stuck reward must not stop training (the rollout source stops the
run when more than reward.max_error_fraction of a round's calls fail). The limit counts the reward
call only: workers (gspo_mcore/rewards/worker.py) import just the reward function, and are
started, and waited for, before any response is timed; a stuck one is killed and replaced.

`RewardRunner.from_config` is how training (the rollout source) and evaluation build one: the same
reward section read the same way, and each dataset's answers read by the reward's own check
before any server starts."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import select
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from gspo_mcore.common.errors import InputError
from gspo_mcore.common.processes import kill_worker, read_json_reply, start_worker
from gspo_mcore.rewards import call_arguments, load_reward_fn, reward_arguments
from gspo_mcore.rewards.worker import reward_hook

STARTUP_TIMEOUT_S = 300.0  # importing a heavy reward (a math checker, a tokenizer) on a busy node


@dataclass
class RewardStats:
    errors: int = 0
    timeouts: int = 0
    masked: int = 0  # responses the reward could not score (it returned None): None with `masking`, else 0
    # What each failure said ("response i: <exception>"), in order: the run quotes the first
    # and keeps them all in its logs.
    messages: list[str] = field(default_factory=list)
    # The reward module's own counts (its reward_metrics(), gspo_mcore.rewards.worker), summed over calls.
    metrics: dict[str, float] = field(default_factory=dict)
    # Why a response scored as it did, by its index: the reward's reward_reasons() (the code
    # reward's first failing test) or the failed call's message; for OUTPUT_DIR/samples.
    reasons: dict[int, object] = field(default_factory=dict)


class _Worker:
    """One worker process and its private request/reply pipe pair."""

    def __init__(self, reward_name: str, batched: bool = False, options: dict | None = None):
        # The repository and the trainer's sys.path (a reward named `tests.x:f` or a module
        # beside the config), so the worker imports what the trainer could.
        path = os.pathsep.join([str(Path.cwd()), *filter(None, sys.path)])
        env = {**os.environ, "PYTHONPATH": path}
        argv = [sys.executable, "-m", "gspo_mcore.rewards.worker", reward_name, *(["--batched"] if batched else []),
                *(["--options", json.dumps(options)] if options is not None else [])]
        self.process = start_worker(argv, env)
        self.reward_name = reward_name
        self.busy_with: list[int] | None = None  # the responses it is scoring
        self.started = 0.0  # when it got them

    def ready(self, deadline: float) -> None:
        reply = self.read(max(0.0, deadline - time.monotonic()))
        if reply != "ready":
            reason = reply["error"] if isinstance(reply, dict) else "no answer in time"
            self.kill()
            raise InputError(f"reward {self.reward_name!r}: its worker did not start ({reason})")

    def send(self, job: list[int], request: list) -> None:
        # default=str: a Parquet record's dates and decimals reach the reward as text
        self.process.stdin.write(json.dumps(request, default=str) + "\n")
        self.process.stdin.flush()
        self.busy_with, self.started = job, time.monotonic()

    def read(self, timeout_s: float):
        return read_json_reply(self.process, timeout_s)

    def kill(self) -> None:
        kill_worker(self.process)


class RewardRunner:
    """`score(responses, answers, contexts, groups) -> (rewards, stats)` over `workers` processes,
    started once. `batched`: the reward takes a group's lists in one call (gspo_mcore.rewards).
    `options`: handed to the reward's `reward_options` hook in each worker (reward.code's
    settings). `masking`: a response the reward returned None for (could not score) keeps None
    (the rollout source drops it from its group); otherwise it scores 0. Counted either way."""

    def __init__(self, reward_name: str, timeout_s: float = 10.0, workers: int = 2, batched: bool = False,
                 url: str | None = None, options: dict | None = None, masking: bool = False):
        # Fail fast on a bad name or signature, in this process.
        self.fn = load_reward_fn(reward_name)
        self.wanted = reward_arguments(self.fn, reward_name, url)
        self.reward_name, self.timeout_s, self.workers = reward_name, timeout_s, workers
        self.batched, self.url, self.options, self.masking = batched, url, options, masking
        self._pool: list[_Worker] = []
        self.closed = False

    @classmethod
    def from_config(cls, reward, name: str | None = None, samples=(), evaluation: bool = False) -> "RewardRunner":
        """The runner of a run config's `reward` section (gspo_mcore.config.RewardConfig, read here,
        not imported: rewards sit below config), the one way training and evaluation build it.
        `name`: an evaluation dataset's own reward; when it is reward.name it is called as in
        training (reward.batched, reward.url), another reward once per response (reward.url if it
        takes one). `evaluation`: a response the reward could not score (None) scores 0, as pass@k
        needs every sample; training masks it when reward.code.infrastructure_errors is `mask`.
        `samples` (gspo_mcore.data.PromptSample rows): every answer is read by the reward's
        `reward_check_answer(answer, where)` hook where it has one (the code rewards), so a dataset
        the reward cannot read stops the run at data load, before any server starts."""
        name = name or reward.name
        own = name == reward.name
        takes_url = "url" in inspect.signature(load_reward_fn(name)).parameters
        runner = cls(name, reward.timeout_s, reward.workers, batched=reward.batched if own else False,
                     url=reward.url if own or takes_url else None, options=dataclasses.asdict(reward.code),
                     masking=not evaluation and reward.code.infrastructure_errors == "mask")
        runner.check_answers(samples)
        return runner

    def check_answers(self, samples) -> None:
        """Each sample's answer through the reward's `reward_check_answer` hook (none: nothing to check)."""
        check = reward_hook(self.fn, "reward_check_answer")
        for index, sample in enumerate(samples if check is not None else ()):
            check(sample.answer, getattr(sample, "where", "") or f"record {index + 1}")

    def _start(self, count: int) -> list[_Worker]:
        started = [_Worker(self.reward_name, self.batched, self.options) for _ in range(count)]
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for worker in started:
            worker.ready(deadline)
        return started

    def _jobs(self, count: int, groups: list[int] | None) -> list[list[int]]:
        """The calls: one per response, or (batched) one per group (all of them: one group)."""
        if not self.batched:
            return [[i] for i in range(count)]
        by_group: dict[int, list[int]] = {}
        for i, group in enumerate(groups if groups is not None else [0] * count):
            by_group.setdefault(group, []).append(i)
        return list(by_group.values())

    def _request(self, job: list[int], responses, answers, contexts) -> list:
        """[args, kwargs] of one call, as the worker takes it."""
        kwargs = [call_arguments(self.wanted, contexts[i], self.url) for i in job] if self.wanted else [{}] * len(job)
        if not self.batched:
            return [[responses[job[0]], answers[job[0]]], kwargs[0]]
        lists = {key: self.url if key == "url" else [k.get(key) for k in kwargs] for key in self.wanted}
        return [[[responses[i] for i in job], [answers[i] for i in job]], lists]

    def score(self, responses: list[str], answers: list[str], contexts: list[dict] | None = None,
              groups: list[int] | None = None) -> tuple[list[float | None], RewardStats]:
        """`contexts`: per response, the CONTEXT of gspo_mcore.rewards (needed when the reward asks
        for any of it); `groups`: per response, its prompt's group (the calls of a batched reward)."""
        if self.closed:
            raise RuntimeError(f"reward {self.reward_name!r}: scored after its runner was closed")
        if len(responses) != len(answers):
            raise ValueError(f"{len(responses)} responses but {len(answers)} answers")
        if self.wanted and contexts is None:
            raise ValueError(f"reward {self.reward_name!r} takes {list(self.wanted)}: contexts needed")
        self._pool += self._start(self.workers - len(self._pool))
        rewards, stats = [0.0] * len(responses), RewardStats()
        todo = self._jobs(len(responses), groups)
        while todo or any(w.busy_with is not None for w in self._pool):
            for worker in list(self._pool):  # _replace changes the pool
                if worker.busy_with is None and todo:
                    job = todo.pop(0)
                    try:
                        worker.send(job, self._request(job, responses, answers, contexts))
                    except OSError:  # it died between calls: a fresh one takes the job next round
                        todo.insert(0, job)
                        self._replace(worker)
            busy = [w for w in self._pool if w.busy_with is not None]
            if busy:
                self._collect(busy, rewards, stats)
        return rewards, stats

    def _collect(self, busy: list[_Worker], rewards: list[float], stats: RewardStats) -> None:
        """Wait for the first reply or deadline among `busy`; take every reply there is."""
        soonest = min(w.started + self.timeout_s for w in busy)
        readable = select.select([w.process.stdout for w in busy], [], [], max(0.0, soonest - time.monotonic()))[0]
        for worker in busy:
            job = worker.busy_with
            if worker.process.stdout in readable:
                reply = worker.read(0)
                worker.busy_with = None
                for key, value in (reply.get("metrics") or {}).items() if isinstance(reply, dict) else ():
                    stats.metrics[key] = stats.metrics.get(key, 0) + value
                if reply is not None and "rewards" in reply:
                    said = zip(job, reply.get("reasons") or ())
                    stats.reasons.update((i, why) for i, why in said if why is not None)
                    for i, value in zip(job, reply["rewards"]):
                        rewards[i] = value if value is not None or self.masking else 0.0
                        if value is None:
                            stats.masked += 1
                            stats.messages.append(f"response {i}: the reward returned None (it could not score "
                                                  f"it: {'masked' if self.masking else 'scored 0'})")
                    continue
                stats.errors += len(job)  # it raised, returned NaN, or its process died
                said = reply.get("error", "failed") if isinstance(reply, dict) else "its worker process died"
                stats.messages += [f"response {i}: {said}" for i in job]
                stats.reasons.update((i, f"reward error: {said}") for i in job)
                if reply is None:
                    self._replace(worker)
            elif time.monotonic() >= worker.started + self.timeout_s:
                stats.timeouts += len(job)
                stats.messages += [f"response {i}: timed out after {self.timeout_s:g} s (reward.timeout_s)" for i in job]
                stats.reasons.update((i, f"reward timed out after {self.timeout_s:g} s") for i in job)
                self._replace(worker)

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self._pool.remove(worker)
        self._pool += self._start(1)

    def close(self) -> None:
        """Kill the workers; a later `score` is refused (a group thread of a closed run's producer)."""
        for worker in self._pool:
            worker.kill()
        self._pool = []
        self.closed = True
