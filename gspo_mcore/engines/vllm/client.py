"""vLLM's token-in / token-out route for the generation client (gspo_mcore.engines.client):
`/inference/v1/generate` (the server runs with --enable-scale-out), token ids in; token ids,
per-token log-probs, weight-version spans and routed experts out, streamed (server-sent events:
`request_timeout_s` bounds each silence, not a whole 8k-token response)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid

import aiohttp

from gspo_mcore.engines.client import Aborted, EngineClient, RetryableError
from gspo_mcore.engines.vllm.response import finish_reason, generated_count, parse_generate_response
from gspo_mcore.common.errors import RequestRefused
from gspo_mcore.common.http import ConnectionFailure, HTTPRequestError, HTTPStatusError, error_detail, post_json
from gspo_mcore.batch.rollout import Rollout

GENERATE = "/inference/v1/generate"
# What vLLM 0.33 answers (HTTP 503) to a request sent while a pause in abort mode holds the server.
PAUSED = "Generation is paused"
PAUSED_RETRY_S = 0.25


async def post_events(session: aiohttp.ClientSession, url: str, data: bytes, timeout_s: float) -> list[dict]:
    """POST `data` (a request with "stream": true) and read the server-sent events until
    `data: [DONE]`: their JSON objects. `timeout_s` bounds connecting and each wait for more of the
    stream (aiohttp's sock_read): a response that keeps streaming tokens never times out, a stalled
    one does. Read in chunks, not lines: the last event carries the routed experts (megabytes)."""
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout_s, sock_read=timeout_s)
    events, pending = [], b""
    try:
        async with session.post(url, data=data, timeout=timeout,
                                headers={"Content-Type": "application/json"}) as response:
            if response.status >= 400:
                raw = await response.read()
                raise HTTPStatusError(response.status, error_detail(raw) if raw else "")
            async for chunk in response.content.iter_any():
                pending += chunk
                *complete, pending = pending.split(b"\n\n")
                for event in complete:
                    body = event.strip().removeprefix(b"data:").strip()
                    if body == b"[DONE]":
                        return events
                    if body:
                        events.append(json.loads(body))
    except aiohttp.ClientConnectorError as err:
        raise ConnectionFailure(f"URLError: {err.os_error}") from None
    except asyncio.TimeoutError:
        raise ConnectionFailure(f"TimeoutError: nothing streamed for {timeout_s:g} s") from None
    except ValueError as err:  # an event cut off or garbled
        raise ConnectionFailure(f"{type(err).__name__}: {err}") from None
    except (aiohttp.ClientError, OSError) as err:  # disconnected, reset
        raise ConnectionFailure(f"{type(err).__name__}: {err}") from None
    raise ConnectionFailure("the stream ended before [DONE]")


def merged_answer(events: list[dict]) -> dict:
    """One answer in the non-streamed shape (gspo_mcore.engines.vllm.response reads it) from a
    stream's events (GenerateTokensStreamResponse): token ids and log-prob entries concatenated in
    order; the finish reason, routed experts and weight-version spans from the event that carries
    them (vLLM sets the last two on the final chunk only, covering the whole output:
    OutputProcessor, `finished`)."""
    choice = {"token_ids": [], "logprobs": {"content": []}, "finish_reason": None, "routed_experts": None,
              "weight_versions": None}
    for event in events:
        if not isinstance(event, dict) or "error" in event:  # a generation error, mid-stream
            raise RetryableError(f"stream error: {str(event)[:200]}")
        for part in event.get("choices") or []:
            choice["token_ids"] += part.get("token_ids") or []
            choice["logprobs"]["content"] += (part.get("logprobs") or {}).get("content") or []
            for key in ("finish_reason", "routed_experts", "weight_versions"):
                if part.get(key) is not None:
                    choice[key] = part[key]
    return {"choices": [choice]}


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
        # Our own request id (GenerateRequest.request_id), one per attempt, so a response can be
        # found in the server's log (Rollout.origin).
        request_id = uuid.uuid4().hex
        body = {"token_ids": list(prompt_ids), "sampling_params": vllm_sampling_params(sampling_params),
                "stream": True, "request_id": request_id}
        try:
            events = await post_events(self.loop_thread.session, f"{url}{GENERATE}", json.dumps(body).encode(),
                                       self.request_timeout_s)
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
        payload = merged_answer(events)
        if finish_reason(payload) == "abort":
            raise Aborted(generated_count(payload))
        rollout = parse_generate_response(f"{index}", prompt_ids, payload, self.vocab_size, weight_version,
                                          self.routing_shape, oldest_version)
        # vLLM names it generate-tokens-<id> (OpenAIServing._base_request_id, serving.py).
        return dataclasses.replace(rollout, origin=(f"{url} request_id=generate-tokens-{request_id}",))
