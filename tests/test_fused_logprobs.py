"""model.fused_logprobs through the trainer's own forward (gspo_mcore.megatron.qwen3_moe.forward:
the output layer's input and weight taken from megatron-core's GPTModel, the log-probs without the
logits): the same figures as the logits path. The trainer's exactness against Hugging Face with
the switch on (its default) under every layout, TP=2 with sequence parallelism included:
tests/test_train_step.py, tests/test_gspo_step.py; the math alone: tests/test_logprobs.py."""

import json

import pytest

from helpers import run_module

pytestmark = pytest.mark.slow  # a learner in a process of its own, torchrun for two ranks

# In a process of its own: the learner joins gloo process groups and the CPU bridge patches torch.cuda.
AB = """
import json, sys
import torch
from gspo_mcore.batch.rollout import Batch, Rollout
from gspo_mcore.config import load_config
from gspo_mcore.gspo import logprobs
from gspo_mcore.megatron.learner import Learner
from gspo_mcore.megatron.qwen3_moe import forward

calls = []  # the forwards that handed their loss the LinearLogits
linear_logits = forward.linear_logits
forward.linear_logits = lambda *args: calls.append(1) or linear_logits(*args)
# Blocks of 200 logits: ragged blocks of the tiny model's 256 words (the default holds it whole).
logprobs.token_logprobs.__kwdefaults__["chunk_elements"] = 200
hf_dir, seen = sys.argv[1], {}
rollouts = [Rollout([1, 2, 3], [4, 5, 6, 7 + i], [-0.5] * 4, "stop", "v0") for i in range(4)]
for fused in ("false", "true"):
    # Temperature, the entropy bonus and a KL term (the reference model's forward-only log-probs);
    # one SGD step at lr 1: the weights moved by the gradient itself.
    config = load_config(None, [f"model.hf_dir={hf_dir}", f"model.fused_logprobs={fused}", "rollout.temperature=0.7",
                                "loss.entropy_coef=0.1", "loss.kl_loss_coef=0.1", "optimizer.name=sgd", "optimizer.distributed_optimizer=false",
                                "optimizer.lr=1.0", "optimizer.clip_grad=0", "train.num_minibatches=1"])
    with Learner(config) as learner:
        arm = {"logprobs": learner.token_logprobs_of(learner.ddp, rollouts)}
        # The engine's log-probs those of the logits path's forward (a real engine's are close to the trainer's).
        engine = seen["false"]["logprobs"] if seen else arm["logprobs"]
        batch = [Rollout(r.prompt_ids, r.response_ids, lp, "stop", "v0") for r, lp in zip(rollouts, engine)]
        report = learner.update(Batch(batch, [1.0, -1.0, 0.5, -0.5], {}), step=0)
        arm.update(loss=report["loss"], grad_norm=report["grad_norm"], entropy=report.get("entropy"),
                   weights={name: p.detach().flatten().tolist() for name, p in learner.model.named_parameters()
                            if name.startswith(("embedding", "output_layer", "decoder.final_layernorm"))})
    seen[fused], arm["fused_forwards"] = arm, len(calls)
    calls.clear()
print(json.dumps(seen))
"""


def test_fused_logprobs_through_the_learner_give_the_logits_paths_figures(tmp_path):
    """Tied embeddings (the output weight is the embedding's: its gradient from both ends),
    temperature 0.7, entropy bonus, KL against the reference model: the recomputed log-probs, the
    loss, the gradient norm and the weights an SGD step at lr 1 leaves (embedding, final norm) are
    the logits path's within float32 rounding."""
    from gspo_mcore.megatron.qwen3_moe.tiny import make_tiny_checkpoint

    hf_dir = make_tiny_checkpoint(tmp_path / "tied", seed=0, tie_word_embeddings=True)
    script = tmp_path / "ab.py"
    script.write_text(AB)
    seen = json.loads(run_module([str(script), str(hf_dir)]).stdout.strip().splitlines()[-1])
    logits, fused = seen["false"], seen["true"]
    # Policy and reference forward only, the update's forward: each the fused path's, or none.
    assert logits["fused_forwards"] == 0 and fused["fused_forwards"] == 3
    assert sum(fused["logprobs"], []) == pytest.approx(sum(logits["logprobs"], []), abs=1e-6)
    assert fused["loss"] == pytest.approx(logits["loss"], rel=1e-6, abs=1e-7)
    assert fused["grad_norm"] == pytest.approx(logits["grad_norm"], rel=1e-6) and logits["grad_norm"] > 0
    assert fused["entropy"] == pytest.approx(logits["entropy"], rel=1e-6)
    assert set(fused["weights"]) == set(logits["weights"]) and "output_layer.weight" not in fused["weights"]
    for name, values in logits["weights"].items():
        assert fused["weights"][name] == pytest.approx(values, abs=1e-6), name


TP2 = """
import json, sys
import torch
import torch.distributed as dist
from gspo_mcore.gspo.logprobs import LinearLogits, token_logprobs

dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()
g = torch.Generator().manual_seed(0)
hidden, weight = torch.randn(2, 9, 16, generator=g), torch.randn(60, 16, generator=g) * 0.4
target = torch.randint(0, 60, (2, 9), generator=g)
weights, entropy_weights = torch.randn(2, 9, generator=g), torch.randn(2, 9, generator=g)
shard = slice(rank * 30, (rank + 1) * 30)  # this rank's vocabulary slice of the output layer
figures = {}
for path in ("whole", "tp"):
    h = hidden.clone().requires_grad_(True)
    w = (weight if path == "whole" else weight[shard]).clone().requires_grad_(True)
    logits = LinearLogits(h, w) if path == "tp" else h @ w.t()
    logprobs, entropy = token_logprobs(logits, target, temperature=0.7, with_entropy=True, chunk_elements=40,
                                       group=dist.group.WORLD if path == "tp" else None)
    grad_h, grad_w = torch.autograd.grad((logprobs * weights + entropy * entropy_weights).sum(), (h, w))
    if path == "tp":
        dist.all_reduce(grad_h)  # each rank's share of the hidden gradient, summed (the TP copy's backward)
        parts = [torch.empty_like(grad_w) for _ in range(size)]
        dist.all_gather(parts, grad_w)
        grad_w = torch.cat(parts)
    figures[path] = [t.flatten().tolist() for t in (logprobs, entropy, grad_h, grad_w)]
if rank == 0:
    print(json.dumps(figures))
dist.destroy_process_group()
"""


@pytest.mark.slow  # torchrun
def test_fused_logprobs_vocabulary_parallel_over_two_ranks(tmp_path):
    """TP=2 over gloo: each rank holds half the output weight; the log-sum-exp (max, then the
    sums of exponentials) and the target's logit (from the rank that holds its id) all-reduced:
    the log-probs, entropy and gradients of the whole vocabulary on one rank."""
    script = tmp_path / "tp2.py"
    script.write_text(TP2)
    figures = json.loads(run_module([str(script)], nproc=2).stdout.strip().splitlines()[-1])
    for name, tp, whole in zip(("log-probs", "entropy", "grad hidden", "grad weight"), figures["tp"], figures["whole"]):
        scale = max([1.0] + [abs(v) for v in whole])  # float32 rounding: 1e-6 of the figure's scale
        assert max(abs(a - b) for a, b in zip(tp, whole)) <= 1e-6 * scale, name
