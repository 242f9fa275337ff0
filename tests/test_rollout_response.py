"""Parsing and validating SGLang /generate responses, on responses recorded from a real
SGLang 0.5.23 server (tests/fixtures), and batching them for the loss."""

import copy
import json
import math

import pytest
import torch

from conftest import REPO
from gspo_mcore.packing import collate
from gspo_mcore.rollout.response import RolloutError, parse_generate_response

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


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda p: p["meta_info"]["output_token_logprobs"].pop(), "4 log-probs for 5 generated tokens"),
        (lambda p: p["meta_info"]["output_token_logprobs"][2].__setitem__(0, math.nan), "invalid log-prob nan at token 2"),
        (lambda p: p["meta_info"]["output_token_logprobs"][1].__setitem__(0, None), "invalid log-prob None at token 1"),
        (lambda p: (p["output_ids"].__setitem__(3, 999), p["meta_info"]["output_token_logprobs"][3].__setitem__(1, 999)),
         "token id 999 at 3 outside the vocabulary"),
        (lambda p: p["meta_info"]["output_token_logprobs"][0].__setitem__(1, 7), "log-prob 0 is for token 7"),
        (lambda p: p["meta_info"].__setitem__("finish_reason", {"type": "abort", "message": "x"}), "aborted"),
        (lambda p: p.pop("output_ids"), "malformed response"),
    ],
)
def test_bad_responses_are_rejected_by_name(corrupt, message):
    prompt, payload = recorded(0)
    corrupt(payload)
    with pytest.raises(RolloutError, match="request sample-7: " + message.replace("(", r"\(")):
        parse_generate_response("sample-7", prompt, payload, VOCAB)


def test_unexpected_weight_version_is_rejected():
    with pytest.raises(RolloutError, match="weight version 'default', expected '3'"):
        parse_generate_response("r", *recorded(0), VOCAB, weight_version="3")
