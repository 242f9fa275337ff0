"""The layout planner on the shipped GPU configs, and its errors for impossible layouts."""

import json
import subprocess
import sys

import pytest

from conftest import REPO
from gspo_mcore.config import ConfigError, load_config
from gspo_mcore.errors import InputError
from gspo_mcore.models.qwen3_moe.hf_config import load_hf_config
from gspo_mcore.plan import param_counts, plan

HF_30B = REPO / "configs/hf/qwen3-30b-a3b.config.json"
HF_235B = REPO / "configs/hf/qwen3-235b-a22b.config.json"


def test_parameter_counts_are_the_published_ones():
    small, big = param_counts(load_hf_config(HF_30B)), param_counts(load_hf_config(HF_235B))
    assert small["total"] / 1e9 == pytest.approx(30.5, abs=0.1) and small["active"] / 1e9 == pytest.approx(3.3, abs=0.1)
    assert big["total"] / 1e9 == pytest.approx(235, abs=1) and big["active"] / 1e9 == pytest.approx(22, abs=0.5)


@pytest.mark.parametrize("config, nodes, hf", [
    ("qwen3_30b_a3b_gspo.yaml", 1, HF_30B),
    ("qwen3_30b_a3b_gspo_2node.yaml", 2, HF_30B),
    ("qwen3_235b_a22b_gspo.yaml", 16, HF_235B),
])
def test_shipped_gpu_configs_fit(config, nodes, hf):
    cfg = load_config(REPO / "configs" / config)
    result = plan(cfg, load_hf_config(hf), nodes, 8, 80.0, 512)
    assert result["gpus"] == nodes * 8
    assert 20 < result["trainer_total_gb"] <= 80
    parts = sum(result[f"trainer_{k}_gb"] for k in ("weights", "gradients", "optimizer", "activations", "logits"))
    assert result["trainer_total_gb"] == pytest.approx(parts)
    assert result["train_tflops"] > result["rollout_tflops"] > 0


def test_one_node_30b_needs_the_offload_and_two_nodes_do_not():
    cfg = load_config(REPO / "configs/qwen3_30b_a3b_gspo.yaml", ["optimizer.cpu_offload=false"])
    with pytest.raises(ConfigError, match=r"during training .* need an estimated 9\d\.\d GB per GPU > 80 GB"):
        plan(cfg, load_hf_config(HF_30B), 1, 8, 80.0, 512)
    one = plan(load_config(REPO / "configs/qwen3_30b_a3b_gspo.yaml"), load_hf_config(HF_30B), 1, 8, 80.0, 512)
    assert one["trainer_optimizer_gb"] == 0 and one["host_optimizer_gb_per_gpu"] > 30


@pytest.mark.parametrize("overrides, nodes, message", [
    (["distributed.expert_parallel=7"], 1, "num_experts 128 is not divisible by distributed.expert_parallel = 7"),
    (["distributed.tensor_parallel=8", "distributed.expert_parallel=1"], 1,
     "num_key_value_heads 4 is not divisible by distributed.tensor_parallel = 8"),
    (["distributed.pipeline_parallel=5", "distributed.expert_parallel=1"], 1,
     "num_hidden_layers 48 is not divisible by distributed.pipeline_parallel = 5"),
    (["distributed.expert_parallel=16"], 1,
     "8 trainer GPUs are not divisible by expert_parallel x expert_tensor_parallel x pipeline_parallel = 16"),
    (["distributed.tensor_parallel=4", "distributed.pipeline_parallel=4", "distributed.expert_parallel=1"], 1,
     "8 trainer GPUs are not divisible by tensor_parallel x pipeline_parallel = 16"),
    (["train.rollout_batch_size=2", "train.group_size=8", "rollout.num_servers=4"], 2,
     "16 sequences cannot give each of 4 minibatches one per data-parallel rank"),
    (["weight_sync.colocate=false", "weight_sync.method=distributed", "rollout.num_servers=2", "rollout.engine_tp=4"], 1,
     "servers x engine_tp 4 = 8 GPUs leave none of the 8 for training"),
    (["rollout.engine_tp=16"], 1, "rollout.engine_tp 16 exceeds the 8 GPUs of a node"),
    (["rollout.num_servers=1"], 1, "weight_sync.colocate: 1 servers x rollout.engine_tp 4 must cover the 8 GPUs"),
    (["rollout.engine_tp=3", "rollout.num_servers=1", "weight_sync.colocate=false", "weight_sync.method=distributed"], 1,
     "rollout.engine_tp 3 does not split num_key_value_heads 4"),
])
def test_impossible_layouts_name_the_field(overrides, nodes, message):
    cfg = load_config(REPO / "configs/qwen3_30b_a3b_gspo.yaml", overrides)
    with pytest.raises(InputError, match=message):
        plan(cfg, load_hf_config(HF_30B), nodes, 8, 80.0, 512)


def test_split_mode_reports_sglang_kv_capacity():
    cfg = load_config(REPO / "configs/qwen3_30b_a3b_gspo_2node.yaml",
                      ["weight_sync.colocate=false", "weight_sync.method=distributed", "rollout.num_servers=2", "rollout.engine_tp=4",
                       "distributed.expert_parallel=4", "optimizer.cpu_offload=true"])
    result = plan(cfg, load_hf_config(HF_30B), 2, 8, 80.0, 512)
    assert (result["trainer_gpus"], result["rollout_gpus"]) == (8, 8)
    assert result["sglang_kv_cache_tokens"] > 100_000


@pytest.mark.slow  # the CLI in subprocesses
def test_cli_prints_the_plan_and_one_line_errors():
    cmd = [sys.executable, "-m", "gspo_mcore.plan", "--config", "configs/qwen3_30b_a3b_gspo.yaml",
           "--hf-config", str(HF_30B)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert "8 GPUs: 8 trainer (TP 1 x PP 1 x DP 8; experts EP 8 x ETP 1 x expert-DP 1)" in proc.stdout
    assert json.loads(proc.stdout.strip().splitlines()[-1])["gpus"] == 8
    proc = subprocess.run([*cmd, "--nodes", "3", "distributed.expert_parallel=16", "rollout.num_servers=6"], capture_output=True, text=True,
                          cwd=REPO)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: distributed: 24 trainer GPUs are not divisible")


def test_a_colocated_gpu_holds_the_trainer_and_sglang_together():
    """The 1-node config fits with SGLang's weights, KV cache at max_total_tokens and a margin
    beside the trainer's resident state at the push (and the margin beside its training peak);
    a KV cache that pushes the sum over the GPU is refused (the trainer alone would fit, so the
    old check passed it)."""
    arch = load_hf_config(HF_30B)
    cfg = load_config(REPO / "configs/qwen3_30b_a3b_gspo.yaml")
    result = plan(cfg, arch, 1, 8, 80.0, 512)
    kv_gb = cfg.rollout.max_total_tokens * result["sglang_kv_bytes_per_token"] / 1024**3
    assert result["sglang_resident_gb"] == pytest.approx(result["sglang_weights_gb"] + kv_gb + 4.0)
    static = sum(result[f"trainer_{k}_gb"] for k in ("weights", "gradients", "optimizer"))
    assert result["colocated_push_gb"] == pytest.approx(static + 2 * cfg.weight_sync.bucket_mb / 1024
                                                        + result["sglang_resident_gb"]) and result["colocated_push_gb"] <= 80
    assert result["colocated_training_gb"] == pytest.approx(result["trainer_total_gb"] + 4.0)
    big_cache = load_config(REPO / "configs/qwen3_30b_a3b_gspo.yaml", ["rollout.max_total_tokens=1600000"])
    assert plan(big_cache, arch, 1, 8, 120.0, 512)["trainer_total_gb"] < 80
    with pytest.raises(ConfigError, match=r"weight_sync.colocate: during the weight push .* GB per GPU > 80 GB"):
        plan(big_cache, arch, 1, 8, 80.0, 512)


def test_logits_count_the_contiguous_copy_and_offload_counts_gradient_copies():
    arch = load_hf_config(HF_30B)
    cfg = load_config(REPO / "configs/qwen3_30b_a3b_gspo.yaml")
    result = plan(cfg, arch, 1, 8, 80.0, 512)
    from gspo_mcore.logprobs import DEFAULT_CHUNK_ELEMENTS

    tokens = cfg.train.max_tokens_per_microbatch
    expected = (arch.vocab_size * tokens * 3 * 2 + DEFAULT_CHUNK_ELEMENTS * 4) / 1024**3  # [s,b,v], [b,s,v], grad
    assert result["trainer_logits_gb"] == pytest.approx(expected)
    counts = param_counts(arch)
    # distributed optimizer: dense over DP 8, experts over EP 8 x expert-DP 1; 12 B Adam + fp32
    # master weights, + 4 B pinned gradient copy
    local = counts["dense"] / 8 + counts["experts"] / 8
    assert result["host_optimizer_gb_per_gpu"] == pytest.approx(local * (4 + 8 + 4) / 1024**3, rel=1e-6)
