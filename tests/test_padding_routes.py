"""Padding reaches no expert (#59 item 6): packing marks each input slot real or padding
(`input_real`), GPTModel gets it as its `padding_mask`, and a hook on each router sends padding
tokens nowhere (gspo_mcore/megatron/qwen3_moe/routing.py drop_padding_routes): the experts see
real tokens x top-k, a rank whose microbatch is all padding (a filler) sends nothing through the
all-to-all, the outputs at real positions are those of an unpadded run, and the update reports
`padding_fraction`."""

import json

import pytest
import torch

from gspo_mcore.batch.rollout import Rollout
from gspo_mcore.gspo.packing import filler_microbatch, microbatch_tensors
from gspo_mcore.megatron.qwen3_moe.routing import drop_padding_routes
from helpers import run_module


def rollout(prompt, response):
    return Rollout(list(prompt), list(response), [-0.5] * len(response), "stop", "v0")


def test_input_real_marks_each_rows_tokens_and_nothing_of_the_padding():
    """Rows padded to the longest and T to the TP multiple: True up to each row's length, False
    after; a filler microbatch is all padding."""
    rollouts = [rollout([1, 2, 3], [4, 5, 6, 7]), rollout([8], [9, 10]), rollout([1, 2], [3])]
    mb = microbatch_tensors(rollouts, [1.0, -1.0, 0.5], [0, 1, 2], pad_multiple=4)
    assert mb["inputs"].shape == (3, 8)  # 7 tokens: 6 inputs, padded to 8
    # a row's last token sits in an input slot once T is padded past it: real (its output unused)
    assert mb["input_real"].tolist() == [[True] * 7 + [False] * 1, [True] * 3 + [False] * 5,
                                         [True] * 3 + [False] * 5]
    assert mb["input_real"].dtype == torch.bool
    assert not filler_microbatch(mb)["input_real"].any()


def test_the_router_hook_routes_padding_nowhere_and_keeps_the_rest():
    """The router's (probs, routing_map) for tokens in [T, b] order: padding rows lose every
    expert and probability; real rows are untouched; no mask, no change."""
    torch.manual_seed(0)
    probs, routing_map = torch.rand(6, 4), torch.rand(6, 4) > 0.5
    padding = torch.tensor([[False, False], [False, True], [True, True]])  # [T=3, b=2]
    masked_probs, masked_map = drop_padding_routes(None, (torch.zeros(3, 2, 8), padding), (probs, routing_map))
    dropped = padding.reshape(-1)
    assert not masked_map[dropped].any() and (masked_probs[dropped] == 0).all()
    assert torch.equal(masked_map[~dropped], routing_map[~dropped])
    assert torch.equal(masked_probs[~dropped], probs[~dropped])
    assert drop_padding_routes(None, (torch.zeros(3, 2, 8),), (probs, routing_map)) == (probs, routing_map)


SCRIPT = """
import json, sys
import torch
import torch.distributed as dist
from gspo_mcore.batch.rollout import Rollout
from gspo_mcore.config import load_config
from gspo_mcore.gspo.packing import filler_microbatch, microbatch_tensors
from gspo_mcore.megatron.qwen3_moe.bootstrap import model_from_config
from gspo_mcore.megatron.qwen3_moe.forward import model_output

hf_dir, out = sys.argv[1], sys.argv[2]
config = load_config(None, [f"model.hf_dir={hf_dir}", "distributed.expert_parallel=2", "model.dtype=float32"])
_, model = model_from_config(config)
model.eval()
routed = []
for layer in model.decoder.layers:
    experts = getattr(layer.mlp, "experts", None)
    if experts is not None:
        experts.register_forward_hook(lambda module, args, output: routed.append(int(torch.as_tensor(args[1]).sum())))
k = model.config.moe_router_topk
rollouts = [Rollout([1, 2, 3], [4, 5, 6, 7, 8, 9], [-0.5] * 6, "stop", "v0"),
            Rollout([3, 4], [5], [-0.5], "stop", "v0")]
mb = microbatch_tensors(rollouts, [1.0, -1.0], [0, 1])
if dist.get_rank() == 1:  # this rank's microbatch is a filler: all padding
    mb = filler_microbatch(mb)
seen = {"rank": dist.get_rank(), "real": int(mb["input_real"].sum()), "slots": mb["inputs"].numel(), "k": k}
with torch.no_grad():
    for name, real in (("unmasked", None), ("masked", mb["input_real"])):
        routed.clear()
        logits = model_output(model, mb["inputs"], False, real)
        seen[name] = {"routed": list(routed), "logits": logits[0].tolist() if dist.get_rank() == 0 else None,
                      "short": logits[1, :3].tolist() if dist.get_rank() == 0 else None}
    # the short row alone, without padding (rank 1 runs its filler beside it, the all-to-all's peer)
    alone = mb["inputs"][1:2, :3] if dist.get_rank() == 0 else mb["inputs"][:, :3]
    logits = model_output(model, alone, False, torch.ones_like(alone, dtype=torch.bool) if dist.get_rank() == 0
                          else torch.zeros_like(alone, dtype=torch.bool))
    seen["alone"] = logits[0].tolist() if dist.get_rank() == 0 else None
with open(f"{out}/rank{dist.get_rank()}.json", "w") as f:
    json.dump(seen, f)
dist.destroy_process_group()
"""


@pytest.mark.slow  # torchrun of 2 ranks (~25 s)
def test_under_expert_parallelism_the_experts_see_real_tokens_only_and_real_outputs_stay(tiny_hf_dir, tmp_path):
    """EP 2, one rank's microbatch all padding: per MoE layer the two ranks' experts receive
    (real tokens) x top-k rows in all with the mask, every slot's x top-k without; the first rank's
    logits at real positions equal the unmasked run's and the short row's equal it run alone."""
    script = tmp_path / "padding.py"
    script.write_text(SCRIPT)
    run_module([str(script), str(tiny_hf_dir), str(tmp_path)], nproc=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    k, real, slots = ranks[0]["k"], sum(r["real"] for r in ranks), sum(r["slots"] for r in ranks)
    assert (real, slots) == (11, 24)  # 8 + 3 real inputs of 16 on the first rank; a filler of 8 on the second
    layers = len(ranks[0]["masked"]["routed"])
    assert layers > 0
    per_layer = lambda arm: [sum(r[arm]["routed"][i] for r in ranks) for i in range(layers)]  # noqa: E731
    assert per_layer("masked") == [real * k] * layers and per_layer("unmasked") == [slots * k] * layers
    first = ranks[0]
    torch.testing.assert_close(torch.tensor(first["masked"]["logits"]), torch.tensor(first["unmasked"]["logits"]),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.tensor(first["masked"]["short"]), torch.tensor(first["alone"]),
                               rtol=1e-5, atol=1e-5)
