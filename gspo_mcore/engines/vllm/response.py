"""vLLM's `/inference/v1/generate` answers -> validated rollouts (the checks every engine's
responses pass: gspo_mcore.engines.response_checks).

One choice per request: `token_ids` (the stop token included), `logprobs.content` (per token its
`token_id` and `logprob`: with --logprobs-mode processed_logprobs, of the distribution sampled),
`finish_reason`, `weight_versions` (spans {version, start, end} over the output tokens: the
engine stamps each step with the version it ran, `EngineCore._attach_weight_version`, vllm
0.32.0) and, when asked, `routed_experts` (base64 of a `.npy` array [tokens - 1, layers, top-k])."""

from __future__ import annotations

import base64
import binascii
import io

import numpy as np

from gspo_mcore.engines.response_checks import check_ending, check_logprobs, check_versions
from gspo_mcore.common.errors import RolloutError
from gspo_mcore.batch.rollout import Rollout


def _choice(request: str, payload: dict) -> dict:
    try:
        (choice,) = payload["choices"]
    except (KeyError, TypeError, ValueError) as err:
        raise RolloutError(f"request {request}: malformed response ({err!r})") from None
    if not isinstance(choice, dict):
        raise RolloutError(f"request {request}: malformed response (a choice that is not an object)")
    return choice


def generated_count(payload: dict) -> int:
    """Tokens an (aborted) answer carries."""
    try:
        return len(payload["choices"][0].get("token_ids") or [])
    except (KeyError, TypeError, IndexError, AttributeError):
        return 0


def finish_reason(payload: dict) -> str | None:
    try:
        return payload["choices"][0].get("finish_reason")
    except (KeyError, TypeError, IndexError, AttributeError):
        return None


def decode_routed_experts(request: str, encoded, num_tokens: int, routing_shape: tuple[int, int]) -> np.ndarray:
    """`routed_experts` for a sequence of `num_tokens` (prompt + response): one row per input token,
    in the smallest unsigned type that holds the expert ids."""
    if not isinstance(encoded, str):
        raise RolloutError(f"request {request}: no routed experts in the response (is the server started with "
                           "--enable-return-routed-experts?)")
    try:
        routed = np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)
    except (binascii.Error, ValueError, OSError) as err:
        raise RolloutError(f"request {request}: routed experts are not a base64 .npy array ({err})") from None
    layers, top_k = routing_shape
    if routed.shape != (num_tokens - 1, layers, top_k) or routed.dtype.kind not in "iu":
        raise RolloutError(f"request {request}: routed experts of shape {routed.shape} ({routed.dtype}), expected "
                           f"({num_tokens - 1}, {layers}, {top_k}) integers")
    largest = int(routed.max()) if routed.size else 0
    if routed.size and int(routed.min()) < 0:
        raise RolloutError(f"request {request}: a negative expert id in the routed experts")
    dtype = np.uint8 if largest < 2**8 else np.uint16 if largest < 2**16 else np.int32
    return routed.astype(dtype, copy=False)


def parse_generate_response(
    request: str, prompt_ids: list[int], payload: dict, vocab_size: int, weight_version: str | None = None,
    routing_shape: tuple[int, int] | None = None, oldest_version: int | None = None,
) -> Rollout:
    """One `/inference/v1/generate` answer (asked with `logprobs: 0`), as json.loads reads it.
    `request` names it in errors. `weight_version` (synchronous runs): every token must come from
    it; `oldest_version` (asynchronous runs): no token may come from an older step."""
    choice = _choice(request, payload)
    try:
        response_ids = np.asarray(choice["token_ids"], dtype=np.int64).reshape(-1)
        entries = (choice.get("logprobs") or {}).get("content") or []
        entry_ids = np.fromiter((e["token_id"] for e in entries), dtype=np.int64, count=len(entries))
        values = np.fromiter((e["logprob"] for e in entries), dtype=np.float64, count=len(entries))
        spans = choice.get("weight_versions") or []
        kind = choice.get("finish_reason")
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as err:
        raise RolloutError(f"request {request}: malformed response ({err!r})") from None
    check_ending(request, kind, len(entries), len(response_ids))
    wrong = np.flatnonzero(entry_ids != response_ids)
    if wrong.size:
        position = int(wrong[0])
        raise RolloutError(f"request {request}: log-prob {position} is for token {int(entry_ids[position])}, "
                           f"not {int(response_ids[position])}")
    check_logprobs(request, response_ids, values, vocab_size)
    try:
        version = str(spans[-1]["version"]) if spans else ""
    except (KeyError, TypeError) as err:
        raise RolloutError(f"request {request}: malformed weight_versions ({err!r})") from None
    steps = check_versions(request, {"weight_versions": spans, "weight_version": version}, version,
                           len(response_ids), weight_version, oldest_version)
    routed = None
    if routing_shape is not None:
        routed = decode_routed_experts(request, choice.get("routed_experts"), len(prompt_ids) + len(response_ids),
                                       routing_shape)
    return Rollout(list(prompt_ids), response_ids.tolist(), values.tolist(), kind, version, routed, steps)
