"""The one FLOPs count (gspo_mcore.planner.flops): model FLOPs against a hand count, hardware FLOPs
apart from them, the trainer's `mfu` / `hfu` and the planner's line."""

from __future__ import annotations

from pathlib import Path

import pytest

from gspo_mcore.config import load_config
from gspo_mcore.megatron.qwen3_moe.hf_config import load_hf_config, parse_hf_config
from gspo_mcore.megatron.qwen3_moe.tiny import TINY_QWEN3_MOE
from gspo_mcore.planner.flops import Flops, peak_flops, update_flops, utilization

REPO = Path(__file__).resolve().parents[1]
CONFIG_30B = REPO / "configs" / "qwen3_30b_a3b_gspo.yaml"
HF_30B = REPO / "configs" / "hf" / "qwen3-30b-a3b.config.json"
PLAIN = ["model.recompute=none", "model.fused_logprobs=false"]  # nothing computed twice


def _count(overrides, arch, lengths, passes: int = 0) -> Flops:
    return update_flops(load_config(CONFIG_30B, list(overrides)), arch, lengths, passes)


def test_the_tiny_models_flops_are_a_hand_count():
    arch = parse_hf_config({"model_type": "qwen3_moe", **TINY_QWEN3_MOE})
    h, layers, q, kv = 64, 4, 4 * 32, 2 * 32  # q heads x head_dim 128, not hidden_size 64
    attention = h * (q + 2 * kv) + q * h + 2 * 32 + 2 * h  # q, k, v, o, q/k norms, 2 RMSNorms
    dense_mlp = 3 * h * 96  # layer 1 (mlp_only_layers)
    moe = h * 8 + 2 * 3 * h * 32  # the router + the top-2 experts, the other 3 layers
    params = layers * attention + dense_mlp + 3 * moe + 256 * h  # + the output layer, not the input embedding
    for lengths in ([10], [7, 20]):
        tokens, squares = sum(lengths), sum(n * n for n in lengths)
        # 6 a parameter a token; causal attention's two GEMMs 2 x 2 x q a (query, key) pair, half the square, x 3
        want = 6 * params * tokens + 3 * 2 * 2 * layers * q * squares / 2
        assert _count(PLAIN, arch, lengths) == Flops(model=pytest.approx(want), hardware=pytest.approx(want))


def test_qwen3_30b_a3bs_flops_per_token_are_6_active_parameters_less_the_embedding_and_attention(capsys):
    from gspo_mcore.planner.costs import flops_per_step
    from gspo_mcore.planner.memory_model import param_counts

    arch, config = load_hf_config(HF_30B), load_config(CONFIG_30B)
    active = param_counts(arch)["active"]
    assert round(active / 1e9, 2) == 3.35
    seq = 512 + config.rollout.max_new_tokens  # the 30B config's shape: the planner's default prompt
    want = 6 * (active - 151936 * 2048) + 6 * 48 * 32 * 128 * seq  # the causal half of 12 x L x width x seq
    got = flops_per_step(config, arch, 512)
    assert got["model_flops_per_token"] == pytest.approx(want)
    sequences = config.train.rollout_batch_size * config.train.group_size
    assert got["train_model_tflops"] == pytest.approx(want * seq * sequences / 1e12)
    assert got["hardware_flops_per_token"] > got["model_flops_per_token"]  # its model.recompute: full


def test_recompute_the_fused_logprobs_and_forward_passes_raise_hardware_flops_not_model_flops():
    arch, lengths = load_hf_config(HF_30B), [4096] * 4
    plain = _count(PLAIN, arch, lengths)
    for more in (["model.recompute=full", "model.fused_logprobs=false"], ["model.fused_logprobs=true"]):
        counted = _count(more, arch, lengths)
        assert counted.model == plain.model and counted.hardware > plain.hardware
    full = _count(["model.recompute=full", "model.fused_logprobs=false"], arch, lengths)
    # the decoder layers' forward again, not the output layer's (outside megatron's recomputed block)
    assert plain.model / 3 - 2 * 151936 * 2048 * 4 * 4096 == pytest.approx(full.hardware - plain.hardware)
    passed = _count(PLAIN, arch, lengths, passes=2)
    assert passed.model == plain.model and passed.hardware == pytest.approx(plain.model * (3 + 2) / 3)
    epochs = _count([*PLAIN, "train.ppo_epochs=2"], arch, lengths)
    assert epochs.model == pytest.approx(2 * plain.model)


def test_the_trainers_mfu_and_hfu_on_a_gpu_and_null_on_cpu():
    from gspo_mcore.batch.rollout import Rollout
    from gspo_mcore.run.utilization import device_peak_flops, step_utilization

    arch = load_hf_config(HF_30B)
    rollouts = [Rollout(list(range(512)), list(range(3584)), [-0.1] * 3584, "stop", "step-0")] * 8
    cuda = load_config(CONFIG_30B)  # model.recompute full
    got = step_utilization(cuda, arch, rollouts, seconds=2.0, gpus=8, peak=989e12)
    flops = update_flops(cuda, arch, [4096] * 8)
    assert got["mfu"] == pytest.approx(flops.model / 2.0 / 8 / 989e12) and got["hfu"] > got["mfu"]
    cpu = load_config(REPO / "configs" / "tiny_cpu.yaml")
    said = []
    assert device_peak_flops(cpu, said.append) is None and said == []  # CPU: no peak, nothing to say
    assert step_utilization(cpu, arch, rollouts, 2.0, 1, None) == {"mfu": None, "hfu": None}
    assert utilization(1e15, 0.0, 1, 989e12) is None


def test_the_peak_table_reads_the_device_name_and_says_once_what_it_does_not_know(monkeypatch):
    import torch

    from gspo_mcore.run.utilization import device_peak_flops

    assert peak_flops("NVIDIA H100 80GB HBM3") == peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12 and peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("Tesla T4") is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla T4")
    said = []
    assert device_peak_flops(load_config(CONFIG_30B), said.append) is None
    assert len(said) == 1 and "Tesla T4" in said[0] and "null" in said[0]


def test_the_planner_prints_model_and_hardware_flops(capsys):
    import json

    from gspo_mcore.common.errors import run_cli
    from gspo_mcore.planner.cli import main

    code = run_cli(lambda: main(["--config", str(CONFIG_30B), "--hf-config", str(HF_30B)]))
    out = capsys.readouterr().out
    result = json.loads(out.splitlines()[-1])
    assert code == 0 and result["train_model_tflops"] < result["train_tflops"]
    assert (f"train {result['train_model_tflops']:.0f} TFLOP model, {result['train_tflops']:.0f} hardware" in out
            and "GFLOP model (6N + attention" in out)
