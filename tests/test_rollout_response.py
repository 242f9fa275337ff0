"""Parsing and validating SGLang /generate responses, on responses recorded from a real
SGLang 0.5.23 server (tests/fixtures), and batching them for the loss."""

import copy
import json
import math

import numpy as np
import pytest
import torch

from helpers import REPO
from gspo_mcore.gspo.packing import collate
from gspo_mcore.common.errors import RolloutError
from gspo_mcore.engines.sglang.response import parse_generate_response

FIXTURE = json.loads((REPO / "tests" / "fixtures" / "sglang_0.5.23_generate.json").read_text())
VOCAB = 256


def recorded(i=0):
    return FIXTURE["request"]["input_ids"][i], copy.deepcopy(FIXTURE["response"][i])


def test_parses_recorded_responses():
    rollouts = [parse_generate_response(f"r{i}", *recorded(i), VOCAB, weight_version="default") for i in range(2)]
    first = rollouts[0]
    assert first.response_ids == FIXTURE["response"][0]["output_ids"] and len(first.logprobs) == 5
    assert first.finish_reason == "length" and first.truncated and first.weight_version == "default"
    assert all(lp < 0 for lp in first.logprobs)


def test_collate_aligns_logprobs_with_predicted_tokens():
    rollouts = [parse_generate_response(f"r{i}", *recorded(i), VOCAB) for i in range(2)]
    batch = collate(rollouts)
    prompt, response = rollouts[1].prompt_ids, rollouts[1].response_ids
    assert batch["tokens"].shape == (2, 9) and batch["mask"].shape == (2, 8)
    assert batch["tokens"][1, : len(prompt) + len(response)].tolist() == prompt + response
    positions = batch["mask"][1].nonzero()[:, 0]
    # Position t predicts token t + 1: exactly the response tokens.
    assert batch["tokens"][1, positions + 1].tolist() == response
    assert torch.allclose(batch["old_logprobs"][1, positions], torch.tensor(rollouts[1].logprobs))


BAD_RESPONSES = [
    (lambda p: p["meta_info"]["output_token_logprobs"].pop(), "4 log-probs for 5 generated tokens"),
    (lambda p: p["meta_info"]["output_token_logprobs"][2].__setitem__(0, math.nan), "invalid log-prob nan at token 2"),
    (lambda p: p["meta_info"]["output_token_logprobs"][1].__setitem__(0, None), "invalid log-prob None at token 1"),
    (lambda p: (p["output_ids"].__setitem__(3, 999), p["meta_info"]["output_token_logprobs"][3].__setitem__(1, 999)),
     "token id 999 at 3 outside the vocabulary"),
    (lambda p: p["meta_info"]["output_token_logprobs"][0].__setitem__(1, 7), "log-prob 0 is for token 7"),
    (lambda p: p["meta_info"].__setitem__("finish_reason", {"type": "abort", "message": "x"}), "aborted"),
    (lambda p: p.pop("output_ids"), "malformed response"),
]


@pytest.mark.parametrize("corrupt, message", BAD_RESPONSES)
def test_bad_responses_are_rejected_by_name(corrupt, message):
    prompt, payload = recorded(0)
    corrupt(payload)
    with pytest.raises(RolloutError, match="request sample-7: " + message.replace("(", r"\(")):
        parse_generate_response("sample-7", prompt, payload, VOCAB)


def test_unexpected_weight_version_is_rejected():
    with pytest.raises(RolloutError, match="weight version 'default', expected '3'"):
        parse_generate_response("r", *recorded(0), VOCAB, weight_version="3")


def test_routed_experts_decoded_per_input_token():
    import base64

    import numpy as np

    from gspo_mcore.gspo.packing import input_aligned_routing

    routed = np.arange(7 * 2 * 3, dtype=np.int32).reshape(7, 2, 3) % 8  # prompt 5 + response 3 -> 7 inputs
    payload = {"output_ids": [5, 6, 7], "meta_info": {
        "output_token_logprobs": [[-0.5, 5, None], [-0.25, 6, None], [-1.0, 7, None]],
        "finish_reason": {"type": "stop"}, "weight_version": "v", "routed_experts": base64.b64encode(routed.tobytes()).decode()}}
    rollout = parse_generate_response("0", [1, 2, 3, 4, 9], payload, 256, "v", routing_shape=(2, 3))
    assert np.array_equal(rollout.routed_experts, routed)
    assert rollout.routed_experts.dtype == np.uint8  # ids of 8 experts: a byte each, not int32's four
    with pytest.raises(RolloutError, match=r"42 routed-expert ids for 7 input tokens x 4 layers"):
        parse_generate_response("0", [1, 2, 3, 4, 9], payload, 256, "v", routing_shape=(4, 3))
    missing = {**payload, "meta_info": {k: v for k, v in payload["meta_info"].items() if k != "routed_experts"}}
    with pytest.raises(RolloutError, match="--enable-return-routed-experts"):
        parse_generate_response("0", [1, 2, 3, 4, 9], missing, 256, "v", routing_shape=(2, 3))
    # As model inputs see them: padded rows name distinct experts and are not real tokens.
    laid_out = input_aligned_routing([rollout], num_experts=8, width=9)
    assert torch.equal(laid_out["routing"][0, :7], torch.from_numpy(routed).long())
    assert laid_out["routing"][0, 7:].tolist() == [[[0, 1, 2]] * 2] * 2
    assert laid_out["real_inputs"][0].tolist() == [1.0] * 7 + [0.0] * 2
    assert laid_out["older_inputs"][0].tolist() == [0.0] * 9  # nothing said: the trainer's weights routed it
    # Routed by older weights (asynchronous modes): its real rows are compared apart.
    pair = input_aligned_routing([rollout, rollout], num_experts=8, width=9, routed_by_older=[False, True])
    assert pair["older_inputs"].tolist() == [[0.0] * 9, [1.0] * 7 + [0.0] * 2]


def _spanning(spans):
    """Recorded response 0 (5 tokens) as continued across weight updates: SGLang's spans."""
    prompt, payload = recorded(0)
    payload["meta_info"]["weight_version"] = spans[-1][0]
    payload["meta_info"]["weight_versions"] = [{"version": v, "start": a, "end": b} for v, a, b in spans]
    return prompt, payload


def test_a_response_continued_across_updates_carries_each_tokens_version():
    spans = [("step-3", 0, 2), ("step-4", 2, 5)]
    rollout = parse_generate_response("r", *_spanning(spans), VOCAB, oldest_version=3)
    assert rollout.token_versions == (3, 3, 4, 4, 4) and rollout.oldest_version == 3
    assert rollout.weight_version == "step-4"
    # Synchronous runs accept one version only; asynchronous ones no token older than the bound.
    with pytest.raises(RolloutError, match="generated by weight version 'step-3', expected 'step-4'"):
        parse_generate_response("r", *_spanning(spans), VOCAB, weight_version="step-4")
    with pytest.raises(RolloutError, match=r"a token of weight version 'step-3', older than step-4 \(rollout.max_staleness\)"):
        parse_generate_response("r", *_spanning(spans), VOCAB, oldest_version=4)
    with pytest.raises(RolloutError, match="weight_versions do not cover output token 2"):
        parse_generate_response("r", *_spanning([("step-3", 0, 2), ("step-4", 3, 5)]), VOCAB, oldest_version=3)
    one = parse_generate_response("r", *recorded(0), VOCAB)  # no spans: the response's one version
    assert one.token_versions == () and one.weight_version == "default"


def _from_bytes(payload, **dumps):
    from gspo_mcore.engines.sglang.response import decode_generate_body

    return decode_generate_body(json.dumps(payload, **dumps).encode())


@pytest.mark.parametrize("dumps", [{}, {"separators": (",", ":")}, {"indent": 1}])
def test_the_raw_body_reads_as_json_does(dumps):
    """decode_generate_body (numpy for the long arrays) gives the rollout json.loads gives, exactly,
    however the JSON is laid out (SGLang writes it compact; indented falls back to json)."""
    import sys

    sys.path.insert(0, str(REPO / "bench"))
    from client import canned_body  # float32 log-probs, as the engine sends them

    before, after = canned_body(1, 3000, 151936, seed=0)
    bench = json.loads(before + b"4" + after)
    for prompt, payload in [recorded(0), recorded(1), ([1, 2, 3, 4], bench)]:
        fast = parse_generate_response("r", prompt, _from_bytes(payload, **dumps), 151936)
        reference = parse_generate_response("r", prompt, payload, 151936)
        assert fast == reference and fast.logprobs == [e[0] for e in payload["meta_info"]["output_token_logprobs"]]
    decoded = _from_bytes(bench, separators=(",", ":"))
    assert isinstance(decoded["meta_info"]["output_token_logprobs"], np.ndarray)  # the fast path was taken
    assert _from_bytes({"authorization": "k"}) == {"authorization": "k"}


@pytest.mark.parametrize("index", range(7))
def test_bad_raw_bodies_are_rejected_by_the_same_name(index):
    corrupt, message = BAD_RESPONSES[index]
    prompt, payload = recorded(0)
    corrupt(payload)
    with pytest.raises(RolloutError, match="request sample-7: " + message.replace("(", r"\(")):
        parse_generate_response("sample-7", prompt, _from_bytes(payload, separators=(",", ":")), VOCAB)
