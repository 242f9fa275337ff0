"""The generation client every engine's builds on: concurrent requests to one or more servers,
with retries. An engine's client (gspo_mcore/engines/<name>/client.py) says how one request is
sent and read (`request`) and how a server aborts everything in flight (`abort_all`).

Each prompt is one request with a fixed slot in the result list, so a retried request can
neither be lost nor counted twice. Connection errors, timeouts, 5xx answers and aborted
generations are retried with exponential backoff, moving to the next server; when a
request runs out of attempts the whole call fails, naming the request and the server, and
the call's other requests are cancelled.

The requests run on one event loop, on a thread of the client's own (rank 0 also drives the
trainer: a thread per request held the GIL for every response it read), at most
`max_concurrency` in flight over every caller at once (what the servers run together).
Callers on other threads block (`generate`, `generate_one`); coroutines await
(`generate_one_async`, from any event loop).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import threading
import time
import weakref
from abc import ABC, abstractmethod

from gspo_mcore.engines.base import check_sampling_params, server_urls
from gspo_mcore.common.errors import RolloutError
from gspo_mcore.common.http_async import open_session
from gspo_mcore.batch.rollout import Rollout


class RetryableError(Exception):
    pass


class LoopStopped(Exception):
    pass


class Aborted(Exception):
    """The server aborted the generation (`generated`: the tokens it had made)."""

    def __init__(self, generated: int = 0, why: str = "generation aborted by the server"):
        super().__init__(why)
        self.generated = generated


class LoopThread:
    """An event loop on a daemon thread, started at the first `submit`, and the aiohttp session
    it serves. `stop` ends it for good: what is still running is cancelled, the session closed."""

    def __init__(self, name: str, api_key: str | None):
        self.name, self.api_key = name, api_key
        self.lock = threading.RLock()  # RLock: close() may run in a signal handler inside submit()
        self.loop = self.thread = self.session = None
        self.stopped = False

    def submit(self, coroutine) -> concurrent.futures.Future:
        with self.lock:
            if self.stopped:
                coroutine.close()
                raise LoopStopped
            if self.loop is None:
                self.loop = asyncio.new_event_loop()
                self.thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
                self.thread.start()
                asyncio.run_coroutine_threadsafe(self._open(), self.loop).result()
            return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    async def _open(self) -> None:
        self.session = open_session(self.api_key)

    def _serve(self) -> None:
        self.loop.run_forever()
        self.loop.run_until_complete(self._finish())
        self.loop.close()

    async def _finish(self) -> None:
        """Once stopped: what was submitted before ends cancelled (no caller waits forever), and
        the connections close."""
        tasks = asyncio.all_tasks() - {asyncio.current_task()}
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.session.close()

    def stop(self, timeout_s: float = 10.0) -> None:
        with self.lock:
            started, self.stopped = self.loop is not None and not self.stopped, True
        if started:
            self.loop.call_soon_threadsafe(self.loop.stop)
            if threading.current_thread() is not self.thread:
                self.thread.join(timeout_s)


class BusyClock:
    """Per server: the seconds with a request in flight while generation is not paused. What
    the engines are not busy with is `engine_idle_fraction` (a synchronous run idles them while
    it trains and pushes; an asynchronous one only while paused or out of admissible work)."""

    def __init__(self, urls: list[str]):
        self.lock = threading.Lock()
        self.in_flight, self.busy = dict.fromkeys(urls, 0), dict.fromkeys(urls, 0.0)
        self.since, self.paused = time.monotonic(), False

    def _advance(self) -> None:  # with the lock held
        now = time.monotonic()
        if not self.paused:
            for url, running in self.in_flight.items():
                self.busy[url] += (now - self.since) if running else 0.0
        self.since = now

    def started(self, url: str, delta: int = 1) -> None:
        with self.lock:
            self._advance()
            self.in_flight[url] += delta

    def set_paused(self, paused: bool) -> None:
        with self.lock:
            self._advance()
            self.paused = paused

    def busy_s(self) -> float:
        """Busy seconds so far, averaged over the servers."""
        with self.lock:
            self._advance()
            return sum(self.busy.values()) / len(self.busy)


class Slots:
    """The requests in flight, at most `size`, on the client's loop. A request marked `first`
    (evaluation: the trainer waits on it) takes the next free slot before any other waiting."""

    def __init__(self, size: int):
        self.free = size
        self.waiting: tuple[collections.deque, collections.deque] = (collections.deque(), collections.deque())

    async def acquire(self, first: bool = False) -> None:
        if self.free > 0 and not any(self.waiting):
            self.free -= 1
            return
        turn = asyncio.get_running_loop().create_future()
        self.waiting[0 if first else 1].append(turn)
        try:
            await turn  # release() handed its slot over
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():  # handed over as we were cancelled: pass it on
                self.release()
            elif turn in self.waiting[0 if first else 1]:  # release() may have dropped it already
                self.waiting[0 if first else 1].remove(turn)
            raise

    def release(self) -> None:
        for queue in self.waiting:
            while queue:
                turn = queue.popleft()
                if not turn.done():
                    turn.set_result(None)
                    return
        self.free += 1


class EngineClient(ABC):
    name = "engine-client"  # the loop thread's name

    def __init__(self, urls: list[str], vocab_size: int, *, request_timeout_s: float = 600.0,
                 max_attempts: int = 5, backoff_s: float = 1.0, max_concurrency: int = 64,
                 routing_shape: tuple[int, int] | None = None, api_key: str | None = None):
        """`routing_shape` (layers, top-k): also ask for each token's routed experts (the servers
        must be started to return them). `api_key`: the servers' API key."""
        self.urls = server_urls(urls)
        self.routing_shape, self.api_key = routing_shape, api_key
        self.vocab_size, self.request_timeout_s = vocab_size, request_timeout_s
        self.max_attempts, self.backoff_s, self.max_concurrency = max_attempts, backoff_s, max_concurrency
        self.closed = False
        self.clock = BusyClock(self.urls)
        # Pushes that aborted the requests in flight on purpose (rollout.partial: false): those
        # requests start over from their prompt at once, without using an attempt.
        # A request restarted (or sent) while such a push is under way waits on the paused server,
        # where an abort-mode pause can abort it again (SGLang's pause_generation aborts every
        # registered request each second until none runs; vLLM 0.33 refuses it): it starts over too.
        self.interruptions, self.tokens_regenerated, self.interrupting = 0, 0, False
        self.requests_retried = 0  # attempts that failed and were tried again (a timeout, a 5xx, a lost connection)
        self.count_lock = threading.Lock()
        self.loop_thread = LoopThread(self.name, api_key)
        weakref.finalize(self, self.loop_thread.stop)  # a client dropped unclosed ends its thread too
        self.slots: Slots | None = None  # the requests in flight; made on the loop
        self.requests: set[asyncio.Task] = set()  # those running (on the loop)

    def interrupt(self) -> None:
        """Before a pause that aborts the requests in flight (rollout.partial: false)."""
        with self.count_lock:
            self.interruptions += 1
            self.interrupting = True

    def end_interrupt(self) -> None:
        """After the push and the resume: an abort of a request sent from now on is the server's, not ours."""
        self.interrupting = False

    def close(self) -> None:
        """Stop for good (asynchronous producers at the end of a run): requests in flight are
        aborted on the servers and cancelled here, so their callers return, and none is retried."""
        self.closed = True
        for url in self.urls:
            self.abort_all(url)
        if self.loop_thread.loop is not None:  # requests were sent
            try:
                self.loop_thread.submit(self._cancel_requests()).result(timeout=10)
            except (LoopStopped, concurrent.futures.TimeoutError):
                pass
        self.loop_thread.stop()

    async def _cancel_requests(self) -> None:
        requests = list(self.requests)
        for task in requests:
            task.cancel()
        await asyncio.gather(*requests, return_exceptions=True)

    def run(self, coroutine, name: object = 0):
        """`coroutine` on the client's loop; its result, once done (the calling thread waits). `name`:
        the request a closed client names."""
        try:
            future = self.loop_thread.submit(coroutine)
        except LoopStopped:
            raise RolloutError(f"request {name}: the client was closed") from None
        try:
            return future.result()
        except concurrent.futures.CancelledError:
            if self.closed:
                raise RolloutError(f"request {name}: the client was closed") from None
            raise
        except BaseException:
            future.cancel()  # interrupted here (a signal): its requests are cancelled there
            raise

    # ---------------------------------------------------------------- what an engine says
    @abstractmethod
    def abort_all(self, url: str) -> None:
        """Abort every request in flight on the server (best effort: a server gone has none)."""

    @abstractmethod
    async def request(self, url: str, index, prompt_ids: list[int], sampling_params: dict,
                      weight_version: str | None, oldest_version: int | None) -> Rollout:
        """One generation on `url` (on the client's loop, its session `self.loop_thread.session`).
        Raises RetryableError (tried again, on the next server), Aborted (the server aborted it),
        RequestRefused (a 4xx: the request itself is wrong) or RolloutError (a malformed answer)."""

    async def _one(self, index, prompt_ids: list[int], sampling_params: dict, weight_version: str | None,
                   oldest_version: int | None = None, server: int | None = None, first: bool = False) -> Rollout:
        """Request `index` (its name in errors) on server `server` (default: spread by index),
        moving on to the next server when one fails. Cancelled by `close`: says the client was closed."""
        task = asyncio.current_task()
        self.requests.add(task)
        try:
            return await self._attempts(index, prompt_ids, sampling_params, weight_version, oldest_version, server,
                                        first)
        except asyncio.CancelledError:
            if self.closed:
                raise RolloutError(f"request {index}: the client was closed") from None
            raise
        finally:
            self.requests.discard(task)

    async def _attempts(self, index, prompt_ids, sampling_params, weight_version, oldest_version, server,
                        first: bool) -> Rollout:
        if self.slots is None:
            self.slots = Slots(self.max_concurrency)
        attempt, error = 0, ""
        while attempt < self.max_attempts:
            if self.closed:
                raise RolloutError(f"request {index}: the client was closed")
            url = self.urls[((index if server is None else server) + attempt) % len(self.urls)]
            try:
                await self.slots.acquire(first)
                try:
                    interruptions, during_push = self.interruptions, self.interrupting
                    self.clock.started(url)
                    try:
                        return await self.request(url, index, prompt_ids, sampling_params, weight_version,
                                                  oldest_version)
                    finally:
                        self.clock.started(url, -1)
                finally:
                    self.slots.release()
            except (Aborted, RetryableError) as err:
                ours = self.interruptions != interruptions or during_push
                if isinstance(err, Aborted) and ours and not self.closed:  # a push aborted it: start over
                    with self.count_lock:
                        self.tokens_regenerated += err.generated
                    continue
                error, attempt = f"server {url}: {err}", attempt + 1
                with self.count_lock:
                    self.requests_retried += 1
                if attempt < self.max_attempts:
                    await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
        raise RolloutError(f"request {index}: failed after {self.max_attempts} attempts; last: {error}")

    async def _all(self, requests: list[tuple]) -> list[Rollout]:
        calls = [asyncio.ensure_future(self._one(*request)) for request in requests]
        try:
            return await asyncio.gather(*calls)
        finally:
            for call in calls:  # the rest, when one failed (their errors are not the call's)
                call.cancel()
                call.add_done_callback(_retrieved)

    def generate_one(self, name: str, prompt_ids: list[int], sampling_params: dict, server: int,
                     weight_version: str | None = None, oldest_version: int | None = None) -> Rollout:
        """One generation from token ids on server `server` first (a multi-turn trajectory stays on
        one server, whose prefix cache then serves its next turn)."""
        check_sampling_params(sampling_params)
        return self.run(self._one(name, prompt_ids, sampling_params, weight_version, oldest_version, server), name)

    async def generate_one_async(self, name: str, prompt_ids: list[int], sampling_params: dict, server: int,
                                 weight_version: str | None = None, oldest_version: int | None = None,
                                 evaluation: bool = False) -> Rollout:
        """`generate_one` for coroutines, on any event loop (rollout functions run on their own).
        `evaluation`: its request goes before the training requests waiting for a slot."""
        check_sampling_params(sampling_params)
        request = self._one(name, prompt_ids, sampling_params, weight_version, oldest_version, server, evaluation)
        try:
            future = self.loop_thread.submit(request)
        except LoopStopped:
            raise RolloutError(f"request {name}: the client was closed") from None
        return await asyncio.wrap_future(future)

    def generate(self, prompts: list[list[int]], sampling_params: dict,
                 weight_version: str | None = None, seeds: list[int] | None = None,
                 oldest_version: int | None = None, evaluation: bool = False) -> list[Rollout]:
        """One rollout per prompt, in prompt order. `seeds`: a sampling seed per request
        (gspo_mcore.common.seeds), so a retried request and a rerun sample the same tokens: vLLM
        seeds the request's own generator with it; SGLang samples with it on a CPU server
        started here (sglang_cpu/shim/gspo_sglang_seeds.py) and on GPU under
        --enable-deterministic-inference. `weight_version` / `oldest_version`:
        what parse_generate_response accepts. `evaluation`: responses nobody trains on (greedy
        decoding allowed), whose requests go before the training requests waiting for a slot (the
        trainer waits on them)."""
        if not evaluation:
            check_sampling_params(sampling_params)
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        # "sampling_seed": the client's own key; each engine's `request` sends it as its server expects.
        params = [sampling_params if seeds is None else {**sampling_params, "sampling_seed": seed} for seed in
                  (seeds if seeds is not None else [None] * len(prompts))]
        if not prompts:
            return []
        return self.run(self._all([(i, p, params[i], weight_version, oldest_version, None, evaluation)
                                   for i, p in enumerate(prompts)]))


def _retrieved(task: asyncio.Task) -> None:
    """A task whose outcome nobody reads (asyncio would log its error as never retrieved)."""
    if not task.cancelled():
        task.exception()
