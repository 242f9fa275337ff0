"""SGLang `/generate` responses -> validated rollouts (training tensors: gspo_mcore.gspo.packing).

The engine's per-token log-probs are GSPO's pi_old, so a response is accepted only if they
are complete and sane: one finite log-prob per generated token, token ids inside the
vocabulary, and (when the caller says which) the weight version it expects. Anything else
is a `RolloutError` naming the request, never a silently wrong ratio.

A response of n tokens is two long arrays (`output_ids`, `output_token_logprobs`) and a few
small fields. `decode_generate_body` reads the two arrays from the raw bytes with numpy: as
Python lists they were n small lists per response, and the cyclic garbage collector walking
them took most of the client's time. The checks are vectorised over the arrays alike.
"""

from __future__ import annotations

import base64
import json

import numpy as np

from gspo_mcore.engines.response_checks import check_ending, check_versions
from gspo_mcore.common.errors import RolloutError
from gspo_mcore.batch.rollout import Rollout

# `null` read as a number by one byte-for-byte translation (n->1, u->e, l->9: 1e99), brackets as
# blanks: `[[-0.5,5,null],...]` becomes `  -0.5,5,1e99 ,...` for numpy's text parser.
NULL = 1e99
_AS_NUMBERS = bytes.maketrans(b"[]nul", b"  1e9")
_NUMERIC = b"0123456789+-.eE, \t\r\n[]nul"  # any other byte (NaN, Infinity, a string): the json path


def _array_span(raw: bytes, key: bytes, nested: bool) -> tuple[int, int] | None:
    """Where the array value of `key` lies in `raw` (`nested`: of arrays of numbers)."""
    at = raw.find(b'"' + key + b'":')
    if at < 0:
        return None
    start = at + len(key) + 3
    start += len(raw[start:start + 16]) - len(raw[start:start + 16].lstrip())
    if raw[start:start + 1] != b"[":
        return None
    closing = b"]]" if nested and not raw[start + 1:start + 17].lstrip().startswith(b"]") else b"]"
    end = raw.find(closing, start)
    return None if end < 0 else (start, end + len(closing))


def _numbers(text: bytes, count: int) -> np.ndarray | None:
    """`count` comma-separated numbers (null as NULL), or None if `text` is anything else."""
    if count == 0:
        return np.zeros(0) if not text.strip(b" \t\r\n[]") else None
    if text.translate(None, _NUMERIC) or text.count(b",") != count - 1:
        return None
    try:
        values = np.fromstring(text.translate(_AS_NUMBERS), dtype=np.float64, sep=",")
    except ValueError:
        return None
    return values if values.size == count else None


def _string_span(raw: bytes, key: bytes) -> tuple[int, int] | None:
    """Where the string value of `key` lies in `raw`, quotes included, if it holds no escape
    (base64 has none: SGLang's routed experts)."""
    at = raw.find(b'"' + key + b'":')
    if at < 0:
        return None
    start = raw.find(b'"', at + len(key) + 3)
    end = raw.find(b'"', start + 1)
    if start < 0 or end < 0 or raw[at + len(key) + 3:start].strip() or b"\\" in raw[start:end]:
        return None
    return start, end + 1


def _fast(raw: bytes) -> dict | None:
    """`raw` decoded with output_ids (int64) and meta_info.output_token_logprobs (float64 [n, 3],
    null as NULL) as numpy arrays, and meta_info.routed_experts (megabytes of base64) left as
    bytes; None where the body is not laid out as SGLang writes it."""
    ids_span = _array_span(raw, b"output_ids", nested=False)
    entries_span = _array_span(raw, b"output_token_logprobs", nested=True)
    if ids_span is None or entries_span is None:
        return None
    routed_span = _string_span(raw, b"routed_experts") if b'"routed_experts":' in raw else None
    cuts = sorted([(ids_span, b"[]"), (entries_span, b"[]")] + ([(routed_span, b'""')] if routed_span else []))
    if any(left[0][1] > right[0][0] for left, right in zip(cuts, cuts[1:])):
        return None
    pieces, at = [], 0
    for (start, end), placeholder in cuts:
        pieces += [raw[at:start], placeholder]
        at = end
    payload = json.loads(b"".join(pieces) + raw[at:])
    meta = payload.get("meta_info") if isinstance(payload, dict) else None
    if not isinstance(meta, dict) or payload.get("output_ids") != [] or meta.get("output_token_logprobs") != []:
        return None  # the keys were found elsewhere than SGLang puts them
    if routed_span is not None:
        if meta.get("routed_experts") != "":
            return None
        meta["routed_experts"] = raw[routed_span[0] + 1:routed_span[1] - 1]  # base64, decoded where it is read
    ids_text, entries_text = raw[ids_span[0] + 1:ids_span[1] - 1], raw[entries_span[0]:entries_span[1]]
    rows = entries_text.count(b"[") - 1
    ids = _numbers(ids_text, ids_text.count(b",") + 1 if ids_text.strip() else 0)
    entries = _numbers(entries_text, 3 * rows)
    if ids is None or entries is None:
        return None
    entries, integral = entries.reshape(rows, 3), ids.astype(np.int64)
    if not np.array_equal(integral, ids) or not (entries[:, 2] == NULL).all():  # not [log-prob, id, null]
        return None
    payload["output_ids"], meta["output_token_logprobs"] = integral, entries
    return payload


def decode_generate_body(raw: bytes) -> object:
    """A `/generate` answer's JSON, its two long arrays as numpy arrays when it is SGLang's
    (see the module docstring); any other JSON as json.loads reads it (ValueError if none)."""
    payload = _fast(raw) if b'"output_token_logprobs"' in raw else None
    return json.loads(raw) if payload is None else payload


def _entry_table(entries) -> np.ndarray:
    """float64 [n, 2]: each entry's log-prob and token id (None as NULL)."""
    if isinstance(entries, np.ndarray):
        return entries[:, :2]
    rows = [(NULL if e[0] is None else e[0], NULL if e[1] is None else e[1]) for e in entries]
    return np.array(rows, dtype=np.float64).reshape(len(entries), 2)


def _as_written(entries, position: int, column: int):
    """The value an entry holds, as the response wrote it (None for null), for messages."""
    if not isinstance(entries, np.ndarray):
        return entries[position][column]
    value = float(entries[position, column])
    return None if value == NULL else int(value) if column == 1 and value.is_integer() else value


def check_tokens(request: str, response_ids: np.ndarray, entries, vocab_size: int) -> np.ndarray:
    """The log-probs (float64), once each entry is for its token, finite, <= 0, and each token inside
    the vocabulary; else the first position's problem, in that order."""
    table = _entry_table(entries)
    values, entry_ids = table[:, 0], table[:, 1]
    wrong_token = entry_ids != response_ids
    bad_value = ~(np.isfinite(values) & (values <= 0))
    outside = (response_ids < 0) | (response_ids >= vocab_size)
    problems = np.flatnonzero(wrong_token | bad_value | outside)
    if problems.size:
        position = int(problems[0])
        token = int(response_ids[position])
        if wrong_token[position]:
            raise RolloutError(f"request {request}: log-prob {position} is for token "
                               f"{_as_written(entries, position, 1)}, not {token}")
        if bad_value[position]:
            raise RolloutError(f"request {request}: invalid log-prob {_as_written(entries, position, 0)!r} "
                               f"at token {position}")
        raise RolloutError(f"request {request}: token id {token} at {position} outside the vocabulary ({vocab_size})")
    return values


def decode_routed_experts(request: str, encoded, num_tokens: int, routing_shape: tuple[int, int]) -> np.ndarray:
    """SGLang's `meta_info.routed_experts` (base64 of int32 [tokens, layers, top-k]) for a
    sequence of `num_tokens` (prompt + response): one row per input token, in the smallest
    unsigned type that holds the ids (uint8 up to 256 experts: Qwen3-MoE's 128 are a quarter of
    int32's bytes, ~3 MB instead of ~12 MB an 8k-token response, pickled to every trainer rank)."""
    if not isinstance(encoded, (str, bytes)):
        raise RolloutError(f"request {request}: no routed experts in the response (is the server started with "
                           "--enable-return-routed-experts?)")
    layers, top_k = routing_shape
    flat = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
    if flat.size != (num_tokens - 1) * layers * top_k:
        raise RolloutError(f"request {request}: {flat.size} routed-expert ids for {num_tokens - 1} input tokens x "
                           f"{layers} layers x top-{top_k}")
    if flat.size and flat.min() < 0:
        raise RolloutError(f"request {request}: a negative routed-expert id ({flat.min()})")
    largest = int(flat.max()) if flat.size else 0
    dtype = np.uint8 if largest < 2**8 else np.uint16 if largest < 2**16 else np.int32
    return flat.astype(dtype).reshape(num_tokens - 1, layers, top_k)


def parse_generate_response(
    request: str, prompt_ids: list[int], payload: dict, vocab_size: int, weight_version: str | None = None,
    routing_shape: tuple[int, int] | None = None, oldest_version: int | None = None,
) -> Rollout:
    """One element of SGLang's `/generate` response (made with return_logprob=True and
    logprob_start_len=-1; with `routing_shape` (MoE layers, top-k), return_routed_experts
    too), as json.loads or `decode_generate_body` reads it. `request` names it in errors.
    `weight_version` (synchronous runs): every token must come from it; `oldest_version`
    (asynchronous runs): no token may come from an older step."""
    try:
        response_ids = np.asarray(payload["output_ids"], dtype=np.int64).reshape(-1)
        meta = payload["meta_info"]
        entries = meta["output_token_logprobs"]
        finish = meta["finish_reason"] or {}
        version = str(meta.get("weight_version", ""))
        kind = finish.get("type")
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as err:
        raise RolloutError(f"request {request}: malformed response ({err!r})") from None
    check_ending(request, kind, len(entries), len(response_ids), str(finish.get("message") or ""))
    try:
        logprobs = check_tokens(request, response_ids, entries, vocab_size)
    except (TypeError, ValueError, IndexError) as err:  # an entry that is not [log-prob, token id, ...]
        raise RolloutError(f"request {request}: malformed response ({err!r})") from None
    steps = check_versions(request, meta, version, len(response_ids), weight_version, oldest_version)
    routed = None
    if routing_shape is not None:
        routed = decode_routed_experts(request, meta.get("routed_experts"), len(prompt_ids) + len(response_ids),
                                       routing_shape)
    return Rollout(list(prompt_ids), response_ids.tolist(), logprobs.tolist(), kind, version, routed, steps)
