"""Where the trainer's batches come from, one `get_batch(step)` for every `rollout.mode` (rank 0).

- `SyncProducer`: generate the batch now, with the weights of this step (the default).
- `OneStepOffProducer`: batch k+1 is generated on a thread while batch k trains.
- `AsyncProducer`: groups stay in flight on the servers continuously. Admission is paced so the
  staleness bound holds (AReaL's rule: admit while (max_staleness + version + 1) x batch >
  accepted + running, in groups) and the trainer takes groups in admission order, so a group
  admitted at version v is trained at version v + max_staleness at the latest, whatever its
  length; nothing is discarded for being stale (which would favour short responses).

In both asynchronous modes the trainer pauses the servers around each push (requests keep their
tokens, gspo_mcore.engines.Engine.pause), so a response spans versions and
every token carries its own (Rollout.token_versions).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from gspo_mcore.batch.rollout import Batch, Rollout
from gspo_mcore.rollout.source import RolloutSource


def staleness_metrics(rollouts: list[Rollout], version: int) -> dict:
    """How old the trained tokens are against the weights being updated (`version`), and how
    many responses span several weight versions."""
    if not rollouts or not all(r.token_versions for r in rollouts):
        return {"staleness_mean": None, "staleness_max": None, "staleness_histogram": None,
                "multi_version_fraction": None, "version_span_max": None}
    staleness = [version - r.oldest_version for r in rollouts]
    spans = [max(r.token_versions) - min(r.token_versions) + 1 for r in rollouts]
    return {"staleness_mean": sum(staleness) / len(staleness), "staleness_max": max(staleness),
            "staleness_histogram": [staleness.count(s) for s in range(max(staleness) + 1)],
            "multi_version_fraction": sum(s > 1 for s in spans) / len(spans), "version_span_max": max(spans)}


class EngineMeter:
    """The engines' figures between two batches: `engine_idle_fraction` (1 - the servers' mean
    busy time / wall time, the client's BusyClock), `tokens_regenerated` (tokens generated and
    thrown away because a push aborted their request: 0 with rollout.partial) and
    `requests_retried` (attempts that failed: timed out, refused with a 5xx, lost)."""

    def __init__(self, client):
        self.client = client
        self.last = self._now()

    def _now(self) -> tuple:
        return (time.monotonic(), self.client.clock.busy_s(), self.client.tokens_regenerated,
                self.client.requests_retried)

    def figures(self) -> dict:
        now = self._now()
        (t0, busy0, regen0, retried0), self.last = self.last, now
        wall = max(now[0] - t0, 1e-9)
        return {"engine_idle_fraction": min(1.0, max(0.0, 1.0 - (now[1] - busy0) / wall)),
                "tokens_regenerated": now[2] - regen0, "requests_retried": now[3] - retried0}


class SyncProducer:
    """Every producer is built, its state loaded (a resume's data position, into its source), then
    `start(version)`ed with the weights the engine holds: nothing runs before `start`."""

    def __init__(self, source: RolloutSource, engine=None):
        self.source, self.engine = source, engine
        self.meter = None  # from start(): the engines' figures count from then
        self.unfinished: dict | None = None  # the data position before a batch a signal abandoned

    def start(self, version: int) -> "SyncProducer":
        """Generation may begin: the engine holds weight version `version`. Returns the producer."""
        self.meter = EngineMeter(self.source.client)
        return self

    def get_batch(self, step: int) -> Batch:
        self.unfinished = self.source.state_dict()
        rollouts, advantages, metrics = self.source.collect(step, weight_version=f"step-{step}")
        self.unfinished = None
        return Batch(rollouts, advantages, {**metrics, "trainer_wait_s": 0.0, **self.meter.figures()})

    def pause(self) -> None:
        """Before a push: nothing in flight here (the batch is complete), nothing to pause."""

    def resume(self, version: int) -> None:
        """After a push: nothing to pace here (the next batch names its version itself)."""

    def state_dict(self) -> dict:
        """The data position after the last batch taken (a batch abandoned half-drawn is drawn again)."""
        return self.unfinished or self.source.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's data position, before `start`: the source draws from there."""
        self.source.load_state_dict(state)

    def close(self) -> None:
        pass


class Overlapping:
    """What both asynchronous producers do around a push: pause the servers (their requests keep
    their tokens, or with rollout.partial false are aborted and start over), then continue and
    tell the pacing the new version."""

    def pause(self) -> None:
        partial = self.source.config.rollout.partial
        if not partial:
            self.source.client.interrupt()  # before the abort, so every aborted request sees it
        self.source.client.clock.set_paused(True)
        self.engine.pause(keep_tokens=partial)

    def resume(self, version: int) -> None:
        self.engine.resume()
        if not self.source.config.rollout.partial:
            self.source.client.end_interrupt()
        self.source.client.clock.set_paused(False)
        self.set_version(version)

    def set_version(self, version: int) -> None:
        pass

    def _batch(self, rollouts: list[Rollout], advantages: list[float], metrics: dict, version: int) -> Batch:
        return Batch.spanning(rollouts, advantages, metrics, version)


class OneStepOffProducer(Overlapping, SyncProducer):
    """Batch k+1 is generated while batch k trains: its tokens come from version k (before the
    push that ends step k) or k + 1, and it trains at version k + 1."""

    def __init__(self, source: RolloutSource, max_staleness: int, engine):
        super().__init__(source, engine)
        self.max_staleness = max_staleness
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="one-step-off")
        self.next: tuple[int, Future, dict] | None = None  # (step, batch, sampler state before it)

    def _start(self, step: int) -> None:
        state = self.source.state_dict()
        oldest = max(0, step - self.max_staleness)
        self.next = (step, self.pool.submit(self.source.collect, step, None, oldest), state)

    def get_batch(self, step: int) -> Batch:
        if self.next is None or self.next[0] != step:
            self._start(step)
        began = time.monotonic()
        rollouts, advantages, metrics = self.next[1].result()
        waited = time.monotonic() - began
        self._start(step + 1)
        return self._batch(rollouts, advantages, {**metrics, **staleness_metrics(rollouts, step),
                                                  "staleness_bound": self.max_staleness,
                                                  "trainer_wait_s": waited, **self.meter.figures()}, step)

    def state_dict(self) -> dict:
        """The data position before the batch in flight: a resume generates it again (the responses
        in flight are dropped, their prompts re-queued in the same order)."""
        return self.next[2] if self.next is not None else self.source.state_dict()

    def close(self) -> None:
        self.source.client.close()  # the batch in flight: aborted, its threads return
        self.pool.shutdown(wait=False, cancel_futures=True)


class AsyncProducer(Overlapping):
    """Groups in flight continuously (see the module's docstring). `pause()` / `resume(v)`
    around each push; `get_batch(step)` returns the oldest `rollout_batch_size` groups with signal."""

    def __init__(self, source: RolloutSource, max_staleness: int, engine):
        self.source, self.max_staleness, self.engine = source, max_staleness, engine
        self.meter = None
        self.batch_groups = source.config.train.rollout_batch_size
        self.version = self.start_version = 0
        self.pending: list[dict] = []  # admitted, not yet taken: in admission order
        self.unfinished: dict | None = None  # the position before a batch a signal abandoned
        self.taken = 0  # groups with signal handed to the trainer
        self.admitted = 0
        self.changed = threading.Condition()
        self.closed = False
        self.pool = ThreadPoolExecutor(max_workers=(max_staleness + 1) * self.batch_groups,
                                       thread_name_prefix="async-group")
        self.admitter = threading.Thread(target=self._admit_forever, name="async-admission", daemon=True)

    def start(self, version: int) -> "AsyncProducer":
        """Admission begins, paced from weight version `version` (a resumed run's first step)."""
        self.meter = EngineMeter(self.source.client)
        self.version = self.start_version = version
        self.admitter.start()
        return self

    def _outstanding(self) -> int:
        """Groups accepted (taken or waiting) or still running: what the pacing rule counts."""
        return self.taken + sum(1 for g in self.pending if not g["future"].done() or _kept(g["future"]))

    def _admit_forever(self) -> None:
        while True:
            with self.changed:
                # Versions count from this producer's first batch (a resumed run starts later).
                self.changed.wait_for(lambda: self.closed or self._outstanding() < (
                    self.max_staleness + self.version - self.start_version + 1) * self.batch_groups)
                if self.closed:
                    return
                self._admit()

    def _admit(self) -> None:
        """One more group (called with the lock held): its prompt, drawn now so that groups hold
        the prompts in admission order whichever thread starts first (their seeds follow the
        draw), and the oldest version its tokens may carry (the version now: the engine holds
        nothing older)."""
        state = self.source.state_dict()
        index, self.admitted = self.admitted, self.admitted + 1
        group = {"index": index, "state": state}
        group["future"] = self.pool.submit(self.source.round, 1, 1, None, self.version, self.source.draw(1))
        group["future"].add_done_callback(self._finished)
        self.pending.append(group)

    def _finished(self, future: Future) -> None:
        """Wakes the admission and the trainer. Whether the group was kept is read from the future
        itself: a future is done before its callbacks run (concurrent.futures.Future.set_result),
        and a flag set here was read as "not kept" in between, so a kept group went uncounted and
        one group too many was admitted (staleness 2 under max_staleness 1, seen in CI)."""
        with self.changed:
            self.changed.notify_all()

    def set_version(self, version: int) -> None:
        with self.changed:
            self.version = version
            self.changed.notify_all()

    def get_batch(self, step: int) -> Batch:
        """The next `rollout_batch_size` groups with signal in admission order (waiting for the
        oldest ones to finish); the figures of every group finished on the way."""
        began, rollouts, advantages, rounds, kept = time.monotonic(), [], [], [], 0
        with self.changed:
            self.unfinished = self.pending[0]["state"] if self.pending else None
        while kept < self.batch_groups:
            with self.changed:
                self.changed.wait_for(lambda: self.pending[0]["future"].done() if self.pending else self.closed)
                group = self.pending.pop(0)
                self.unfinished = self.unfinished or group["state"]
                self.taken += _kept(group["future"])
                self.changed.notify_all()
            got, got_advantages, figures = group["future"].result()  # a failed group raises here
            rollouts += got
            advantages += got_advantages
            rounds.append(figures)
            kept += figures["groups_kept"]
        metrics = {**self.source.step_metrics(rounds), "sampling_rounds": len(rounds),
                   **staleness_metrics(rollouts, step), "staleness_bound": self.max_staleness,
                   "trainer_wait_s": time.monotonic() - began, **self.meter.figures()}
        self.unfinished = None
        worst = metrics["staleness_max"]
        if worst is not None and worst > self.max_staleness:  # the pacing rule's promise: a bug if broken
            raise AssertionError(f"staleness {worst} exceeds rollout.max_staleness {self.max_staleness}")
        return self._batch(rollouts, advantages, metrics, step)

    def state_dict(self) -> dict:
        """The data position before the oldest group not yet taken: a resume admits those groups
        again, in the same order (their responses in flight are dropped)."""
        with self.changed:
            if self.unfinished is not None:  # a batch a signal abandoned: its groups are admitted again
                return self.unfinished
            return self.pending[0]["state"] if self.pending else self.source.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's data position, before `start`: admission draws from there."""
        self.source.load_state_dict(state)

    def close(self) -> None:
        with self.changed:
            self.closed = True
            self.changed.notify_all()
        self.source.client.close()  # the groups in flight: aborted, their threads return
        self.pool.shutdown(wait=False, cancel_futures=True)


def _kept(future: Future) -> bool:
    """A finished group's future: did it yield a group with signal (a failed or cancelled one did not)."""
    return not future.cancelled() and future.exception() is None and future.result()[2]["groups_kept"] > 0


def build_producer(source: RolloutSource, engine):
    """`rollout.mode`'s producer, not started. `engine` (gspo_mcore.engines.Engine): pauses the
    servers around pushes."""
    rollout = source.config.rollout
    if rollout.mode == "one_step_off":
        return OneStepOffProducer(source, rollout.max_staleness, engine)
    if rollout.mode == "async":
        return AsyncProducer(source, rollout.max_staleness, engine)
    return SyncProducer(source, engine)
