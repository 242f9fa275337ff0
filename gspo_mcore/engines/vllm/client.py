"""vLLM's token-in / token-out route for the generation client (gspo_mcore.engines.client):
`/inference/v1/generate` (the server runs with --enable-scale-out), token ids in; token ids,
per-token log-probs, weight-version spans and routed experts out."""

from __future__ import annotations

import asyncio
import json

from gspo_mcore.engines.client import Aborted, EngineClient, RetryableError
from gspo_mcore.engines.vllm.response import finish_reason, generated_count, parse_generate_response
from gspo_mcore.errors import RequestRefused
from gspo_mcore.http import ConnectionFailure, HTTPRequestError, HTTPStatusError, post_json
from gspo_mcore.http_async import post_bytes
from gspo_mcore.samples import Rollout

GENERATE = "/inference/v1/generate"
# What vLLM 0.33 answers (HTTP 503) to a request sent while a pause in abort mode holds the server.
PAUSED = "Generation is paused"
PAUSED_RETRY_S = 0.25


def vllm_sampling_params(params: dict) -> dict:
    """The client's sampling parameters as vLLM's SamplingParams reads them: its own names, no
    truncation (top_p 1, top_k 0, min_p 0: the log-probs are then of softmax(logits / T)), the
    sampled token's log-prob only, no text unless stop strings need it."""
    out = {"temperature": params.get("temperature", 1.0), "top_p": 1.0, "top_k": 0, "min_p": 0.0, "logprobs": 0,
           "max_tokens": params["max_new_tokens"]}
    if params.get("stop"):
        out["stop"] = list(params["stop"])
        out["include_stop_str_in_output"] = True  # the stop string's tokens are trained on, as SGLang keeps them
    else:
        out["detokenize"] = False
    if params.get("sampling_seed") is not None:
        out["seed"] = params["sampling_seed"]
    return out


class VLLMClient(EngineClient):
    name = "vllm-client"

    def abort_all(self, url: str) -> None:
        try:
            post_json(f"{url}/abort_requests", {}, 10, self.api_key)
        except HTTPRequestError:
            pass  # a server already gone has nothing in flight

    async def request(self, url: str, index, prompt_ids: list[int], sampling_params: dict,
                      weight_version: str | None, oldest_version: int | None) -> Rollout:
        body = {"token_ids": list(prompt_ids), "sampling_params": vllm_sampling_params(sampling_params)}
        try:
            raw, labelled_json = await post_bytes(self.loop_thread.session, f"{url}{GENERATE}",
                                                  json.dumps(body).encode(), self.request_timeout_s)
        except HTTPStatusError as err:
            if err.status == 503 and PAUSED in err.detail:
                # vLLM >= 0.33 refuses a request sent while an abort-mode pause holds the server
                # (EngineCoreProc._reject_add_while_paused; 0.32 queued it until /resume): to the
                # client, the push aborted it before its first token. Not at once: the push is on.
                await asyncio.sleep(PAUSED_RETRY_S)
                raise Aborted(0, f"refused while paused: HTTP 503: {err.detail}") from None
            if err.status >= 500:
                raise RetryableError(f"HTTP {err.status}") from None
            raise RequestRefused(f"server {url} refused the request: {err}") from None
        except ConnectionFailure as err:  # includes a server dying mid-answer
            raise RetryableError(str(err)) from None
        try:
            payload = json.loads(raw)
        except ValueError as err:
            raise RetryableError(f"not a {GENERATE} answer ({type(err).__name__}: {err})") from None
        if not isinstance(payload, dict):
            raise RetryableError(f"not a {GENERATE} answer: {str(payload)[:100]!r}")
        if finish_reason(payload) == "abort":
            raise Aborted(generated_count(payload))
        return parse_generate_response(f"{index}", prompt_ids, payload, self.vocab_size, weight_version,
                                       self.routing_shape, oldest_version)
