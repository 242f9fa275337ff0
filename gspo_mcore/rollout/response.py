"""SGLang `/generate` responses -> validated rollouts (training tensors: gspo_mcore.packing).

The engine's per-token log-probs are GSPO's pi_old, so a response is accepted only if they
are complete and sane: one finite log-prob per generated token, token ids inside the
vocabulary, and (when the caller says which) the weight version it expects. Anything else
is a `RolloutError` naming the request, never a silently wrong ratio.
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass

import numpy as np

from gspo_mcore.errors import RolloutError


@dataclass(frozen=True)
class Rollout:
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]  # the engine's log-prob of each response token: its behaviour policy's
    finish_reason: str  # "stop" | "length"
    weight_version: str  # the version of the response's last token
    # The engine's routed experts (`rollout.return_routed_experts`): int32 [n, MoE layers,
    # top-k], row t for the forward whose input is token t of prompt + response (the last
    # token is never an input); global expert ids.
    routed_experts: np.ndarray | None = None
    # The weight version (the trainer step whose weights made it) of each response token; a
    # response continued across weight updates (asynchronous modes) spans several.
    token_versions: tuple[int, ...] = ()
    # Per response token: 1 for the model's tokens (trained on), 0 for tokens an environment
    # inserted between turns (a multi-turn trajectory: gspo_mcore.rollout.trajectory); their
    # `logprobs` entries are 0 and never read. Empty: every token is the model's.
    loss_mask: tuple[float, ...] = ()
    reward: float | None = None  # set once scored (gspo_mcore.rollout.source)

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"

    @property
    def mask(self) -> list[float]:
        """1 per response token the loss trains on."""
        return list(self.loss_mask) if self.loss_mask else [1.0] * len(self.response_ids)

    @property
    def oldest_version(self) -> int | None:
        return min(self.token_versions) if self.token_versions else None


def version_number(version: str) -> int | None:
    """The trainer step of a weight version the trainer tagged (`step-N`); None for others."""
    prefix, _, number = version.partition("-")
    return int(number) if prefix == "step" and number.isdigit() else None


def token_versions(request: str, meta: dict, num_tokens: int) -> list[str]:
    """Each output token's weight version, from SGLang's `weight_versions` spans ({version,
    start, end}, end exclusive, over output_ids; sglang/srt/utils/weight_versions.py), or the
    response's one `weight_version` when the engine sent no spans."""
    spans = meta.get("weight_versions")
    if not spans:
        return [str(meta.get("weight_version", ""))] * num_tokens
    versions: list[str | None] = [None] * num_tokens
    try:
        for span in spans:
            for t in range(int(span["start"]), min(int(span["end"]), num_tokens)):
                versions[t] = str(span["version"])
    except (KeyError, TypeError, ValueError) as err:
        raise RolloutError(f"request {request}: malformed weight_versions ({err!r})") from None
    if None in versions:
        raise RolloutError(f"request {request}: weight_versions do not cover output token {versions.index(None)}")
    return versions


def decode_routed_experts(request: str, encoded, num_tokens: int, routing_shape: tuple[int, int]) -> np.ndarray:
    """SGLang's `meta_info.routed_experts` (base64 of int32 [tokens, layers, top-k]) for a
    sequence of `num_tokens` (prompt + response): one row per input token."""
    if not isinstance(encoded, str):
        raise RolloutError(f"request {request}: no routed experts in the response (is the server started with "
                           "--enable-return-routed-experts?)")
    layers, top_k = routing_shape
    flat = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
    if flat.size != (num_tokens - 1) * layers * top_k:
        raise RolloutError(f"request {request}: {flat.size} routed-expert ids for {num_tokens - 1} input tokens x "
                           f"{layers} layers x top-{top_k}")
    return flat.reshape(num_tokens - 1, layers, top_k)


def parse_generate_response(
    request: str, prompt_ids: list[int], payload: dict, vocab_size: int, weight_version: str | None = None,
    routing_shape: tuple[int, int] | None = None, oldest_version: int | None = None,
) -> Rollout:
    """One element of SGLang's `/generate` response (made with return_logprob=True and
    logprob_start_len=-1; with `routing_shape` (MoE layers, top-k), return_routed_experts
    too). `request` names it in errors. `weight_version` (synchronous runs): every token must
    come from it; `oldest_version` (asynchronous runs): no token may come from an older step."""
    try:
        response_ids = [int(t) for t in payload["output_ids"]]
        meta = payload["meta_info"]
        entries = meta["output_token_logprobs"]
        finish = meta["finish_reason"] or {}
        version = str(meta.get("weight_version", ""))
    except (KeyError, TypeError, ValueError) as err:
        raise RolloutError(f"request {request}: malformed response ({err!r})") from None
    kind = finish.get("type")
    if kind == "abort":
        raise RolloutError(f"request {request}: aborted by the server ({finish.get('message', '')})")
    if kind not in ("stop", "length"):
        raise RolloutError(f"request {request}: unknown finish_reason {finish!r}")
    if len(entries) != len(response_ids):
        raise RolloutError(
            f"request {request}: {len(entries)} log-probs for {len(response_ids)} generated tokens"
        )
    logprobs = []
    for position, (entry, token) in enumerate(zip(entries, response_ids)):
        value, entry_token = entry[0], entry[1]
        if entry_token != token:
            raise RolloutError(f"request {request}: log-prob {position} is for token {entry_token}, not {token}")
        if value is None or not math.isfinite(value) or value > 0:
            raise RolloutError(f"request {request}: invalid log-prob {value!r} at token {position}")
        if not 0 <= token < vocab_size:
            raise RolloutError(f"request {request}: token id {token} at {position} outside the vocabulary ({vocab_size})")
        logprobs.append(float(value))
    versions = token_versions(request, meta, len(response_ids))
    wrong = [v for v in versions if weight_version is not None and v != weight_version]
    if wrong or (weight_version is not None and version != weight_version):
        raise RolloutError(f"request {request}: generated by weight version {(wrong or [version])[0]!r}, "
                           f"expected {weight_version!r}")
    numbers = [version_number(v) for v in versions]
    if oldest_version is not None and any(n is None or n < oldest_version for n in numbers):
        bad = next(v for v, n in zip(versions, numbers) if n is None or n < oldest_version)
        raise RolloutError(f"request {request}: a token of weight version {bad!r}, older than step-{oldest_version} "
                           "(rollout.max_staleness)")
    routed = None
    if routing_shape is not None:
        routed = decode_routed_experts(request, meta.get("routed_experts"), len(prompt_ids) + len(response_ids),
                                       routing_shape)
    return Rollout(list(prompt_ids), response_ids, logprobs, kind, version, routed,
                   tuple(n for n in numbers if n is not None) if None not in numbers else ())
