"""Score responses in worker processes with a time limit per response.

A reward that raises or runs past the limit scores 0 and is counted: math checkers can hang
on adversarial output, and a stuck reward must not stop training."""

from __future__ import annotations

import multiprocessing as mp
from dataclasses import dataclass


@dataclass
class RewardStats:
    errors: int = 0
    timeouts: int = 0


def _score_one(reward_name: str, response: str, answer: str) -> float:
    import math

    from gspo_mcore.rewards import load_reward_fn

    value = float(load_reward_fn(reward_name)(response, answer))
    if not math.isfinite(value):  # a NaN would poison the group's advantages: a failure like a raise
        raise ValueError(f"reward {reward_name!r} returned {value}")
    return value


class RewardRunner:
    """`score(responses, answers) -> (rewards, stats)`; workers are spawned once and
    replaced after a timeout (the stuck one is terminated)."""

    def __init__(self, reward_name: str, timeout_s: float = 10.0, workers: int = 2):
        from gspo_mcore.rewards import load_reward_fn

        load_reward_fn(reward_name)  # fail fast on a bad name, in this process
        self.reward_name, self.timeout_s, self.workers = reward_name, timeout_s, workers
        self._pool = None

    def _ensure_pool(self):
        if self._pool is None:
            self._pool = mp.get_context("spawn").Pool(self.workers)
        return self._pool

    def score(self, responses: list[str], answers: list[str]) -> tuple[list[float], RewardStats]:
        if len(responses) != len(answers):
            raise ValueError(f"{len(responses)} responses but {len(answers)} answers")
        rewards, stats = [0.0] * len(responses), RewardStats()
        todo = list(range(len(responses)))
        while todo:
            pool = self._ensure_pool()
            jobs = {i: pool.apply_async(_score_one, (self.reward_name, responses[i], answers[i])) for i in todo}
            todo = []
            order = list(jobs)
            for position, i in enumerate(order):
                try:
                    rewards[i] = jobs[i].get(timeout=self.timeout_s)
                except mp.TimeoutError:
                    stats.timeouts += 1
                    # The stuck worker would starve the rest: collect what finished,
                    # then rerun the others on fresh workers.
                    self.close()
                    for j in order[position + 1:]:
                        if jobs[j].ready():
                            self._collect(jobs[j], j, rewards, stats)
                        else:
                            todo.append(j)
                    break
                except Exception:  # the reward function raised
                    stats.errors += 1
        return rewards, stats

    @staticmethod
    def _collect(job, index, rewards, stats) -> None:
        try:
            rewards[index] = job.get(timeout=0)
        except Exception:
            stats.errors += 1

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None
