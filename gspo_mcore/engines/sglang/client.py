"""Concurrent `/generate` requests to one or more SGLang servers, with retries.

Each prompt is one request with a fixed slot in the result list, so a retried request can
neither be lost nor counted twice. Connection errors, timeouts, 5xx answers and aborted
generations are retried with exponential backoff, moving to the next server; when a
request runs out of attempts the whole call fails, naming the request and the server.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from gspo_mcore.engines.base import check_sampling_params
from gspo_mcore.errors import InputError, RolloutError
from gspo_mcore.http import ConnectionFailure, HTTPRequestError, HTTPStatusError, post_json
from gspo_mcore.engines.sglang.response import parse_generate_response
from gspo_mcore.samples import Rollout


class RetryableError(Exception):
    pass


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


class SGLangClient:
    def __init__(self, urls: list[str], vocab_size: int, *, request_timeout_s: float = 600.0,
                 max_attempts: int = 5, backoff_s: float = 1.0, max_concurrency: int = 64,
                 routing_shape: tuple[int, int] | None = None, api_key: str | None = None):
        """`routing_shape` (MoE layers, top-k): also ask for each token's routed experts (the
        servers must run with --enable-return-routed-experts). `api_key`: the servers' --api-key."""
        if not urls:
            raise InputError("rollout: no server URLs")
        self.urls = [u.rstrip("/") for u in urls]
        self.routing_shape, self.api_key = routing_shape, api_key
        self.vocab_size, self.request_timeout_s = vocab_size, request_timeout_s
        self.max_attempts, self.backoff_s, self.max_concurrency = max_attempts, backoff_s, max_concurrency
        self.closed = False
        self.clock = BusyClock(self.urls)
        # Pushes that aborted the requests in flight on purpose (rollout.partial: false): those
        # requests start over from their prompt at once, without using an attempt.
        # A request restarted (or sent) while such a push is under way waits on the paused server,
        # where SGLang's abort-mode pause can abort it again (TokenizerManager.pause_generation
        # aborts every registered request each second until none runs, and a waiting request is
        # registered): it starts over too.
        self.interruptions, self.tokens_regenerated, self.interrupting = 0, 0, False
        self.count_lock = threading.Lock()

    def interrupt(self) -> None:
        """Before a pause that aborts the requests in flight (rollout.partial: false)."""
        with self.count_lock:
            self.interruptions += 1
            self.interrupting = True

    def end_interrupt(self) -> None:
        """After the push and /continue_generation: an abort of a request sent from now on is the
        server's, not ours."""
        self.interrupting = False

    def close(self) -> None:
        """Stop for good (asynchronous producers at the end of a run): requests in flight are
        aborted on the servers, so the threads waiting on them return, and none is retried."""
        self.closed = True
        for url in self.urls:
            try:
                post_json(f"{url}/abort_request", {"rid": "", "abort_all": True}, 10, self.api_key)
            except HTTPRequestError:
                pass  # a server already gone has nothing in flight

    def _post(self, url: str, body: dict) -> dict:
        try:
            answer = post_json(f"{url}/generate", body, self.request_timeout_s, self.api_key)
        except HTTPStatusError as err:
            if err.status >= 500:
                raise RetryableError(f"HTTP {err.status}") from None
            raise RolloutError(f"server {url} refused the request: {err}") from None
        except ConnectionFailure as err:  # includes a server dying mid-answer
            raise RetryableError(str(err)) from None
        if not isinstance(answer, dict):  # a text answer or a cut-off body, as a broken connection
            raise RetryableError(f"not a /generate answer: {str(answer)[:100]!r}")
        return answer

    def _one(self, index: int, prompt_ids: list[int], sampling_params: dict, weight_version: str | None,
             oldest_version: int | None = None, server: int | None = None) -> Rollout:
        """Request `index` (its name in errors) on server `server` (default: spread by index),
        moving on to the next server when one fails."""
        body = {"input_ids": prompt_ids, "sampling_params": sampling_params, "return_logprob": True,
                "logprob_start_len": -1}
        if self.routing_shape is not None:
            body["return_routed_experts"] = True
        attempt, error = 0, ""
        while attempt < self.max_attempts:
            if self.closed:
                raise RolloutError(f"request {index}: the client was closed")
            url = self.urls[((index if server is None else server) + attempt) % len(self.urls)]
            interruptions, during_push = self.interruptions, self.interrupting
            try:
                self.clock.started(url)
                try:
                    payload = self._post(url, body)
                finally:
                    self.clock.started(url, -1)
                meta = payload.get("meta_info", {})
                if (meta.get("finish_reason") or {}).get("type") == "abort":
                    if (self.interruptions != interruptions or during_push) and not self.closed:  # ours: start over
                        with self.count_lock:
                            self.tokens_regenerated += int(meta.get("completion_tokens") or 0)
                        continue
                    raise RetryableError("generation aborted by the server")
                return parse_generate_response(f"{index}", prompt_ids, payload, self.vocab_size, weight_version,
                                               self.routing_shape, oldest_version)
            except RetryableError as err:
                error, attempt = f"server {url}: {err}", attempt + 1
                if attempt < self.max_attempts:
                    time.sleep(self.backoff_s * 2 ** (attempt - 1))
        raise RolloutError(f"request {index}: failed after {self.max_attempts} attempts; last: {error}")

    def generate_one(self, name: str, prompt_ids: list[int], sampling_params: dict, server: int,
                     weight_version: str | None = None, oldest_version: int | None = None) -> Rollout:
        """One generation from token ids on server `server` first (a multi-turn trajectory stays on
        one server, whose prefix cache then serves its next turn)."""
        check_sampling_params(sampling_params)
        return self._one(name, prompt_ids, sampling_params, weight_version, oldest_version, server)

    def generate(self, prompts: list[list[int]], sampling_params: dict,
                 weight_version: str | None = None, seeds: list[int] | None = None,
                 oldest_version: int | None = None, evaluation: bool = False) -> list[Rollout]:
        """One rollout per prompt, in prompt order. `seeds`: a sampling seed per request (a
        retried request samples the same tokens; used by servers started with
        --enable-deterministic-inference, ignored by others). `weight_version` / `oldest_version`:
        what parse_generate_response accepts. `evaluation`: responses nobody trains on (greedy
        decoding allowed)."""
        if not evaluation:
            check_sampling_params(sampling_params)
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        params = [sampling_params if seeds is None else {**sampling_params, "sampling_seed": seed} for seed in
                  (seeds if seeds is not None else [None] * len(prompts))]
        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, max(1, len(prompts)))) as pool:
            futures = [pool.submit(self._one, i, p, params[i], weight_version, oldest_version)
                       for i, p in enumerate(prompts)]
            try:
                return [f.result() for f in futures]
            except BaseException:
                for f in futures:
                    f.cancel()
                raise
