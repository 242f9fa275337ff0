"""Score responses in worker processes with a time limit per response.

A reward that raises or runs past the limit scores 0 and is counted: math checkers can hang
on adversarial output, and a stuck reward must not stop training. The limit counts the reward
call only: workers (gspo_mcore/rewards/worker.py) import just the reward function, and are
started, and waited for, before any response is timed; a stuck one is killed and replaced."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from gspo_mcore.errors import InputError
from gspo_mcore.processes import die_with_parent, in_main_thread
from gspo_mcore.rewards import load_reward_fn

STARTUP_TIMEOUT_S = 300.0  # importing a heavy reward (a math checker, a tokenizer) on a busy node


@dataclass
class RewardStats:
    errors: int = 0
    timeouts: int = 0


class _Worker:
    """One worker process and its private request/reply pipe pair."""

    def __init__(self, reward_name: str):
        # The repository and the trainer's sys.path (a reward named `tests.x:f` or a module
        # beside the config), so the worker imports what the trainer could.
        path = os.pathsep.join([str(Path.cwd()), *filter(None, sys.path)])
        env = {**os.environ, "PYTHONPATH": path}
        self.process = subprocess.Popen([sys.executable, "-m", "gspo_mcore.rewards.worker", reward_name],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                                        env=env, preexec_fn=die_with_parent if in_main_thread() else None)
        self.reward_name = reward_name
        self.busy_with: int | None = None  # the response index it is scoring
        self.started = 0.0  # when it got that response

    def ready(self, deadline: float) -> None:
        reply = self.read(max(0.0, deadline - time.monotonic()))
        if reply != "ready":
            reason = reply["error"] if isinstance(reply, dict) else "no answer in time"
            self.kill()
            raise InputError(f"reward {self.reward_name!r}: its worker did not start ({reason})")

    def send(self, index: int, response: str, answer: str) -> None:
        self.process.stdin.write(json.dumps([response, answer]) + "\n")
        self.process.stdin.flush()
        self.busy_with, self.started = index, time.monotonic()

    def read(self, timeout_s: float):
        """The next reply, or None if none came within `timeout_s` or the worker died."""
        if not select.select([self.process.stdout], [], [], timeout_s)[0]:
            return None
        line = self.process.stdout.readline()  # one reply per request: never more than one line waiting
        return json.loads(line) if line else None

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            try:
                pipe.close()
            except OSError:
                pass


class RewardRunner:
    """`score(responses, answers) -> (rewards, stats)` over `workers` processes, started once."""

    def __init__(self, reward_name: str, timeout_s: float = 10.0, workers: int = 2):
        load_reward_fn(reward_name)  # fail fast on a bad name, in this process
        self.reward_name, self.timeout_s, self.workers = reward_name, timeout_s, workers
        self._pool: list[_Worker] = []

    def _start(self, count: int) -> list[_Worker]:
        started = [_Worker(self.reward_name) for _ in range(count)]
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for worker in started:
            worker.ready(deadline)
        return started

    def score(self, responses: list[str], answers: list[str]) -> tuple[list[float], RewardStats]:
        if len(responses) != len(answers):
            raise ValueError(f"{len(responses)} responses but {len(answers)} answers")
        self._pool += self._start(self.workers - len(self._pool))
        rewards, stats = [0.0] * len(responses), RewardStats()
        todo = list(range(len(responses)))
        while todo or any(w.busy_with is not None for w in self._pool):
            for worker in list(self._pool):  # _replace changes the pool
                if worker.busy_with is None and todo:
                    i = todo.pop(0)
                    try:
                        worker.send(i, responses[i], answers[i])
                    except OSError:  # it died between calls: a fresh one takes the response next round
                        todo.insert(0, i)
                        self._replace(worker)
            busy = [w for w in self._pool if w.busy_with is not None]
            if not busy:
                continue
            soonest = min(w.started + self.timeout_s for w in busy)
            readable = select.select([w.process.stdout for w in busy], [], [],
                                     max(0.0, soonest - time.monotonic()))[0]
            for worker in busy:
                i = worker.busy_with
                if worker.process.stdout in readable:
                    reply = worker.read(0)
                    worker.busy_with = None
                    if reply is not None and "reward" in reply:
                        rewards[i] = reply["reward"]
                        continue
                    stats.errors += 1  # it raised, returned NaN, or its process died
                    if reply is None:
                        self._replace(worker)
                elif time.monotonic() >= worker.started + self.timeout_s:
                    stats.timeouts += 1
                    self._replace(worker)
        return rewards, stats

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self._pool.remove(worker)
        self._pool += self._start(1)

    def close(self) -> None:
        for worker in self._pool:
            worker.kill()
        self._pool = []
