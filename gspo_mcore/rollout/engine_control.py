"""SGLang's control endpoints (weight updates, versions, cache, memory), one call per server.

Every failure is a `WeightSyncError` naming the server and the endpoint: a half-applied
update must stop the run, never let it train on rollouts of unknown weights.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from gspo_mcore.errors import InputError, WeightSyncError
from gspo_mcore.rollout.http import HTTPRequestError, request_json


class EngineControl:
    def __init__(self, urls: list[str], timeout_s: float = 600.0, api_key: str | None = None):
        """`api_key`: the servers' --api-key (weight loads are admin calls)."""
        if not urls:
            raise InputError("weight sync: no server URLs")
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout_s, self.api_key = timeout_s, api_key

    def call(self, url: str, path: str, body: dict | None = None) -> dict:
        """POST `body` as JSON to url+path; the answer as a dict ({} for a plain-text 200)."""
        answer = self._request(url, path, body, "POST")
        if isinstance(answer, str):
            return {}  # /flush_cache answers with text
        if isinstance(answer, dict) and answer.get("success") is False:
            raise WeightSyncError(f"server {url}{path}: {answer.get('message', answer)}")
        return answer if isinstance(answer, dict) else {"result": answer}

    def on_all(self, path: str, body: dict | None = None) -> list[dict]:
        """The same call on every server at once (a weight-update step must reach all of them)."""
        with ThreadPoolExecutor(max_workers=len(self.urls)) as pool:
            return list(pool.map(lambda url: self.call(url, path, body), self.urls))

    def server_info(self, url: str) -> dict:
        """The server's /get_server_info: its launch arguments and scheduler state."""
        answer = self._request(url, "/get_server_info", None, "GET")  # GET only in SGLang
        if not isinstance(answer, dict):
            raise WeightSyncError(f"server {url}/get_server_info: not a server description: {str(answer)[:200]!r}")
        return answer

    def tp_size(self, url: str) -> int:
        info = self.server_info(url)
        try:
            return int(info.get("tp_size", 1))
        except (TypeError, ValueError):
            raise WeightSyncError(f"server {url}/get_server_info: no tp_size in {str(info)[:200]!r}") from None

    def max_running_requests(self, url: str, default: int) -> int:
        """How many requests the server runs at once (what the rollout client keeps in flight): its
        --max-running-requests, else the scheduler's effective limit (SGLang 0.5.23 reports it in
        internal_states[i].effective_max_running_requests_per_dp), else `default`."""
        info = self.server_info(url)
        states = info.get("internal_states") or [{}]
        for value in (info.get("max_running_requests"), states[0].get("effective_max_running_requests_per_dp")):
            if isinstance(value, int) and value > 0:
                return value
        return default

    def _request(self, url: str, path: str, body: dict | None, method: str) -> object:
        try:
            return request_json(f"{url}{path}", body, self.timeout_s, method=method, api_key=self.api_key)
        except HTTPRequestError as err:  # "HTTP 400: <SGLang's message>", "URLError: <reason>", ...
            raise WeightSyncError(f"server {url}{path}: {err}") from None

    # The weight-update session: SGLang 0.5.23 refuses weight loads outside it (HTTP 400).
    def begin_update(self) -> None:
        self.on_all("/begin_weight_update")

    def end_update(self, weight_version: str) -> None:
        self.on_all("/end_weight_update")
        # Only between rollouts: never abort requests (there are none when the trainer syncs).
        self.on_all("/update_weight_version", {"new_version": weight_version, "abort_all_requests": False})
        self.on_all("/flush_cache")  # KV/prefix cache entries of the old weights

    def pause_generation(self, keep_tokens: bool = True) -> None:
        """Asynchronous runs, before a push: every server stops generating. `keep_tokens`
        (rollout.partial): running requests are retracted, keeping their generated tokens and
        log-probs (SGLang 0.5.23's `retract` mode: Scheduler.retract_all / Req.reset_for_retract
        keep output_ids and the logprob lists), their /generate calls stay open. Otherwise they are
        aborted (mode `abort`: TokenizerManager.pause_generation aborts all and waits until none
        runs) and the client starts them over. Either way weight loads then need no wait."""
        self.on_all("/pause_generation", {"mode": "retract" if keep_tokens else "abort"})

    def continue_generation(self) -> None:
        """After the push: retracted requests are prefilled again (prompt + the tokens so far,
        under the new weights; the earlier tokens keep their log-probs) and continue."""
        self.on_all("/continue_generation", {"torch_empty_cache": False})

    def release_memory(self) -> None:
        """Colocated runs: the engine frees its weights and KV cache while the trainer trains."""
        self.on_all("/release_memory_occupation")

    def resume_memory(self) -> None:
        self.on_all("/resume_memory_occupation")

    def prompt_logprobs(self, url: str, sequences: list[list[int]]) -> list[list[float]]:
        """The engine's log-prob of each token of each sequence given the ones before it
        (positions 1..n-1), from one prefill: the sync check's probe."""
        out = []
        for seq in sequences:  # one at a time: batching with others may change MoE routing
            answer = self.call(url, "/generate", {
                "input_ids": seq, "sampling_params": {"max_new_tokens": 1, "temperature": 1.0},
                "return_logprob": True, "logprob_start_len": 0,
            })
            entries = answer.get("meta_info", {}).get("input_token_logprobs") or []
            values = [e[0] for e in entries[1:]]  # the first token has no log-prob
            if len(values) != len(seq) - 1 or any(v is None for v in values):
                raise WeightSyncError(f"server {url}/generate: no prompt log-probs for the probe sequence")
            out.append([float(v) for v in values])
        return out
