"""The layout planner on the shipped GPU configs, and its errors for impossible layouts."""

import json
import math
import subprocess
import sys

import pytest

from helpers import GIB, GPU_CONFIGS, HF_30B, HF_235B, REPO
from gspo_mcore.config import ConfigError, load_config
from gspo_mcore.common.errors import InputError
from gspo_mcore.gspo.logprobs import DEFAULT_CHUNK_ELEMENTS
from gspo_mcore.megatron.qwen3_moe.hf_config import load_hf_config
from gspo_mcore.planner.cli import main, plan
from gspo_mcore.planner.memory_model import (H100_GB, KV_ROOM_MARGIN_GB, PHASES, TRAINER_CONTEXT_GB, MemoryRefused,
                                             param_counts)

# What the shipped configs keep free on an H100 in their tightest phase: the estimates are
# arithmetic on the shapes (activations within ~1.5x), so ~10% of the GPU stays spare (the KV room
# the colocated configs take is the planner's, which keeps just that).
MIN_MARGIN_GB = KV_ROOM_MARGIN_GB
# The 30B configs' optimizer before #47 item 5 (Adam's states on the host, the gradients kept),
# and fp32 Adam on the GPUs: the tests of those plans name them over the configs' precision-aware default.
OFFLOADED = ["optimizer.precision_aware=false", "optimizer.cpu_offload=true", "optimizer.offload_grad_buffers=false"]
FP32_ADAM = ["optimizer.precision_aware=false", "optimizer.cpu_offload=false", "optimizer.offload_grad_buffers=false"]
# The logits path (model.fused_logprobs false): the tests of the logits' own count name it.
LOGITS = ["model.fused_logprobs=false"]


def _plan(config="qwen3_30b_a3b_gspo.yaml", overrides=(), nodes=1, hf=HF_30B, gpu_gb=H100_GB):
    return plan(load_config(REPO / "configs" / config, list(overrides)), load_hf_config(hf), nodes, 8, gpu_gb, 512)


def test_parameter_counts_are_the_published_ones():
    small, big = param_counts(load_hf_config(HF_30B)), param_counts(load_hf_config(HF_235B))
    assert small["total"] / 1e9 == pytest.approx(30.5, abs=0.1) and small["active"] / 1e9 == pytest.approx(3.3, abs=0.1)
    assert big["total"] / 1e9 == pytest.approx(235, abs=1) and big["active"] / 1e9 == pytest.approx(22, abs=0.5)


def test_every_gpu_config_is_listed_here():
    gpu = {p.name for p in (REPO / "configs").glob("*.yaml") if load_config(p).distributed.device == "cuda"}
    assert gpu == set(GPU_CONFIGS)


@pytest.mark.parametrize("config", sorted(GPU_CONFIGS))
def test_shipped_gpu_configs_fit_every_phase_with_a_margin(config):
    nodes, hf = GPU_CONFIGS[config]
    result = _plan(config, nodes=nodes, hf=hf)
    assert result["gpus"] == nodes * 8
    assert result["usable_gb"] == pytest.approx(79.6 - TRAINER_CONTEXT_GB)
    assert tuple(result["phases_gb"]) == PHASES  # all four (every config runs the sync check)
    assert result["margin_gb"] == pytest.approx(result["usable_gb"] - max(result["phases_gb"].values()))
    assert result["margin_gb"] >= MIN_MARGIN_GB, result["phases_gb"]
    static = sum(result[f"trainer_{k}_gb"] for k in ("weights", "gradients", "optimizer"))
    # the logits and a layer's backward peak apart: the larger counts
    peak = max(result["trainer_activations_gb"], result["trainer_stored_activations_gb"] + result["trainer_logits_gb"])
    assert result["trainer_total_gb"] == pytest.approx(static + peak)
    assert result["train_tflops"] > result["rollout_tflops"] > 0


def test_offload_keeps_the_30b_configs_fitting():
    """Without the offload one node does not fit while training, and two nodes (expert Adam
    states sharded over 2) fit while training but not beside SGLang's KV room."""
    with pytest.raises(ConfigError, match=r"during the training phase .* need an estimated 8\d\.\d GiB per GPU > 77\.6"):
        _plan(overrides=FP32_ADAM)
    with pytest.raises(MemoryRefused, match=r"during the weight push phase .* need an estimated 8\d\.\d GiB") as refused:
        _plan("qwen3_30b_a3b_gspo_2node.yaml", [*FP32_ADAM, "rollout.max_total_tokens=763904"], nodes=2)
    assert refused.value.result["phases_gb"]["training"] < refused.value.result["usable_gb"]
    one = _plan(overrides=OFFLOADED)
    assert one["trainer_optimizer_gb"] == 0 and one["host_optimizer_gb_per_gpu"] > 30


def test_a_config_that_fits_while_training_is_refused_at_the_sync_check():
    """Long probes (prompt + max_new_tokens) make the check forward's logits the largest
    phase; without the check the same config fits."""
    long = ["rollout.max_new_tokens=40960", *LOGITS]
    with pytest.raises(MemoryRefused, match=r"weight_sync.colocate: during the sync check phase .* GiB per GPU > "
                                            r"77\.6 GiB usable .*: lower rollout.max_new_tokens") as refused:
        _plan(overrides=long)
    phases = refused.value.result["phases_gb"]
    assert phases["training"] < phases["sync check"] and phases["training"] < refused.value.result["usable_gb"]
    unchecked = _plan(overrides=[*long, "weight_sync.check_every=0"])
    assert "sync check" not in unchecked["phases_gb"] and unchecked["margin_gb"] > 0


def test_the_phases_add_what_is_resident_in_each():
    """Training: the trainer's peak + SGLang's allowance (released); push: static + bucket +
    SGLang resident; sync check: static + the probe's forward + SGLang; rollout: static + SGLang."""
    arch = load_hf_config(HF_30B)
    cfg = load_config(REPO / "configs/qwen3_30b_a3b_gspo.yaml", LOGITS)
    result = plan(cfg, arch, 1, 8, H100_GB, 512)
    kv_gb = cfg.rollout.max_total_tokens * result["engine_kv_bytes_per_token"] / GIB
    engine = result["engine_weights_gb"] + kv_gb + 4.0
    static = sum(result[f"trainer_{k}_gb"] for k in ("weights", "gradients", "optimizer"))
    assert cfg.optimizer.offload_grad_buffers  # the gradient buffers given back outside the training phase
    resident = static - result["trainer_gradients_gb"]
    probe = 512 + cfg.rollout.max_new_tokens
    logits = (arch.vocab_size * probe * 2 * 2 + DEFAULT_CHUNK_ELEMENTS * 4) / GIB
    assert result["engine_resident_gb"] == pytest.approx(engine) and result["trainer_static_gb"] == pytest.approx(static)
    assert result["phases_gb"] == pytest.approx({
        "training": result["trainer_total_gb"] + 4.0, "weight push": resident + 2 * cfg.weight_sync.bucket_mb / 1024 + engine,
        "sync check": resident + result["trainer_check_forward_gb"] + engine, "rollout": resident + engine})
    # two logits copies of the ~8.7k-token probe (~4.9 GiB) + one layer's forward
    assert logits == pytest.approx(5.0, abs=0.1) and 0 < result["trainer_check_forward_gb"] - logits < 2
    # A KV cache that pushes the sum over the GPU is refused at the push (the trainer alone fits).
    big_cache = ["rollout.max_total_tokens=1600000"]
    assert _plan(overrides=big_cache, gpu_gb=120.0)["trainer_total_gb"] < 77.6 - 4.0  # with the engine's allowance
    with pytest.raises(ConfigError, match=r"weight_sync.colocate: during the weight push phase .* > 77\.6 GiB usable"):
        _plan(overrides=big_cache)


def test_logits_count_two_copies_and_the_recomputed_layer_twice():
    arch = load_hf_config(HF_30B)
    cfg = load_config(REPO / "configs/qwen3_30b_a3b_gspo.yaml", [*OFFLOADED, *LOGITS])
    result = plan(cfg, arch, 1, 8, H100_GB, 512)
    tokens, h = cfg.train.max_tokens_per_microbatch, arch.hidden_size
    # [s,b,v] then its contiguous [b,s,v] copy; in backward that copy and its gradient
    assert result["trainer_logits_gb"] == pytest.approx((arch.vocab_size * tokens * 2 * 2 + DEFAULT_CHUNK_ELEMENTS * 4) / GIB)
    q, kv, k, f = 32 * 128, 4 * 128, 8, 768
    # EP 8: each of the k copies once at the sender, and at the busiest expert rank (2x the mean)
    # the received token and 3 FFN tensors
    layer = tokens * (2 * (4 * h + q + 2 * kv + q) + 2 * k * (h + 2 * (h + 3 * f)))
    # full recompute: each layer's input, + one layer recomputed and its gradients
    assert result["trainer_activations_gb"] == pytest.approx((48 * tokens * 2 * h + 2 * layer) / GIB)
    assert result["trainer_stored_activations_gb"] == pytest.approx(48 * tokens * 2 * h / GIB)
    counts = param_counts(arch)
    # distributed optimizer: dense over DP 8, experts over EP 8 x expert-DP 1; 12 B Adam + fp32
    # master weights, + 4 B pinned gradient copy
    local = counts["dense"] / 8 + counts["experts"] / 8
    assert result["host_optimizer_gb_per_gpu"] == pytest.approx(local * (4 + 8 + 4) / GIB, rel=1e-6)


def test_disk_estimate_counts_adam_states_and_retention():
    result = _plan(overrides=OFFLOADED)
    params = param_counts(load_hf_config(HF_30B))["total"]
    assert result["checkpoint_gb"] == pytest.approx(params * 14 / 1e9) and 420 < result["checkpoint_gb"] < 435
    assert result["hf_export_gb"] == pytest.approx(params * 2 / 1e9)
    assert result["checkpoints_on_disk"] == 4  # keep 3, + the one being written
    smoke = _plan(overrides=["train.steps=2", "train.save_every=0", "train.export_hf=false"])
    assert (smoke["checkpoints_on_disk"], smoke["hf_export_gb"]) == (1, 0.0)  # the end's save only
    nothing = _plan(overrides=["train.steps=2", "train.save_every=0", "train.save_final=false", "train.export_hf=false"])
    assert (nothing["checkpoints_on_disk"], nothing["hf_export_gb"]) == (0, 0.0)
    every = _plan(overrides=["train.steps=100", "train.save_every=10", "train.keep_checkpoints=0"])
    assert every["checkpoints_on_disk"] == 10  # steps 10..90 and the end


@pytest.mark.parametrize("overrides, nodes, message", [
    (["distributed.expert_parallel=7"], 1, "num_experts 128 is not divisible by distributed.expert_parallel = 7"),
    (["distributed.tensor_parallel=8", "distributed.expert_parallel=1"], 1,
     "num_key_value_heads 4 is not divisible by distributed.tensor_parallel = 8"),
    (["distributed.pipeline_parallel=5", "distributed.expert_parallel=1"], 1,
     "num_hidden_layers 48 is not divisible by distributed.pipeline_parallel = 5"),
    (["distributed.expert_parallel=16"], 1,
     "8 trainer ranks are not divisible by expert_parallel x expert_tensor_parallel x pipeline_parallel = 16"),
    (["distributed.tensor_parallel=4", "distributed.pipeline_parallel=4", "distributed.expert_parallel=1"], 1,
     "8 trainer ranks are not divisible by tensor_parallel x pipeline_parallel = 16"),
    (["train.rollout_batch_size=2", "train.group_size=8", "rollout.num_servers=4"], 2,
     "16 sequences cannot give each of 4 minibatches one per data-parallel rank"),
    (["weight_sync.colocate=false", "weight_sync.method=distributed", "rollout.num_servers=2", "rollout.engine_tp=4",
      "optimizer.offload_grad_buffers=false"], 1, "servers x engine_tp 4 = 8 GPUs leave none of the 8 for training"),
    (["rollout.engine_tp=16"], 1, "rollout.engine_tp 16 exceeds the 8 GPUs of a node"),
    (["rollout.num_servers=1"], 1, "weight_sync.colocate: 1 servers x rollout.engine_tp 4 must cover the 8 GPUs"),
    (["rollout.engine_tp=3", "rollout.num_servers=1", "weight_sync.colocate=false", "weight_sync.method=distributed",
      "optimizer.offload_grad_buffers=false"], 1, "rollout.engine_tp 3 does not split num_key_value_heads 4"),
])
def test_impossible_layouts_name_the_field(overrides, nodes, message):
    with pytest.raises(InputError, match=message):
        _plan(overrides=overrides, nodes=nodes)


def test_a_gpu_smaller_than_the_context_is_one_line():
    with pytest.raises(ConfigError, match=r"^--gpu-memory-gb 2: must exceed the trainer's 2 GiB CUDA context$"):
        _plan(gpu_gb=2.0)


def test_split_mode_reports_the_engines_kv_capacity():
    result = _plan("qwen3_30b_a3b_gspo_2node.yaml", [
        "weight_sync.colocate=false", "weight_sync.method=distributed", "rollout.num_servers=2", "rollout.engine_tp=4",
        "distributed.expert_parallel=4", *OFFLOADED], nodes=2)
    assert (result["trainer_gpus"], result["rollout_gpus"]) == (8, 8)
    assert result["engine_kv_cache_tokens"] > 100_000
    assert "engine_resident_gb" not in result and result["phases_gb"]["rollout"] == result["trainer_static_gb"]


@pytest.mark.slow  # the CLI in subprocesses
def _plan_cli(argv, capsys) -> tuple[int, str, str]:
    """`python -m gspo_mcore.planner.cli ARGV` in this process (exit code, stdout, stderr): a process
    per call spent ~15 s importing Megatron; one subprocess below checks the entry point."""
    from gspo_mcore.common.errors import run_cli
    from gspo_mcore.planner.cli import main

    code = run_cli(lambda: main(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_prints_the_phases_the_margin_and_the_breakdown_when_it_refuses(capsys):
    args = ["--config", "configs/qwen3_30b_a3b_gspo.yaml", "--hf-config", str(HF_30B)]
    proc = subprocess.run([sys.executable, "-m", "gspo_mcore.planner.cli", *args], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert "8 GPUs: 8 trainer (TP 1 x PP 1 x DP 8; experts EP 8 x ETP 1 x expert-DP 1)" in proc.stdout
    assert "per GPU by phase (GiB of 77.6 usable: 79.6 less 2 for the trainer's CUDA context" in proc.stdout
    for phase in PHASES:
        assert f" {phase} " in proc.stdout.split("per GPU by phase")[1].splitlines()[0]
    assert "margin: 8.0 GiB per GPU at the weight push phase" in proc.stdout
    assert "disk warning: each checkpoint ~366 GB" in proc.stdout  # the precision-aware optimizer's 12 B a parameter
    assert json.loads(proc.stdout.strip().splitlines()[-1])["gpus"] == 8
    code, out, err = _plan_cli([*args, *FP32_ADAM], capsys)
    assert code == 2 and "per GPU by phase" in out and "(REFUSED)" in out
    assert err.strip().splitlines()[-1].startswith("error: weight_sync.colocate: during the training phase")
    # --shell: KEY=value lines only on stdout (the scripts eval it), the plan on stderr
    code, out, err = _plan_cli([*args, "--shell"], capsys)
    assert code == 0 and all(line.startswith("GSPO_") for line in out.splitlines())
    assert "GSPO_ENGINE=sglang" in out.splitlines()  # the scripts name the servers' logs after it
    assert "margin:" in err
    code, out, err = _plan_cli([*args, "--nodes", "3", "distributed.expert_parallel=16", "rollout.num_servers=6"],
                               capsys)
    assert code == 2
    assert err.strip().splitlines()[-1].startswith("error: distributed: 24 trainer ranks are not divisible")


def test_asynchronous_mode_with_colocated_servers_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"rollout.mode: 'async' overlaps generation and training, which colocated"):
        _plan(overrides=["rollout.mode=async"])


def test_the_readme_planner_command_runs_without_weights_and_the_default_names_the_way(capsys):
    """The README's first planner command works on a fresh checkout (no weights on disk); without
    --hf-config and without the weights, the error names model.hf_dir and --hf-config."""
    import shlex

    from gspo_mcore.planner.cli import main

    line = next(line for line in (REPO / "README.md").read_text().splitlines()
                if line.startswith("python -m gspo_mcore.planner.cli"))
    argv = shlex.split(line)[3:]
    assert "--hf-config" in argv
    argv[argv.index("--hf-config") + 1] = str(REPO / argv[argv.index("--hf-config") + 1])
    argv[argv.index("--config") + 1] = str(REPO / argv[argv.index("--config") + 1])
    assert main(argv) == 0 and "margin:" in capsys.readouterr().out
    with pytest.raises(ConfigError, match=r"^model.hf_dir: .*config.json not found; without the weights on disk "
                                          r"give the model's config.json: --hf-config"):
        main(["--config", str(REPO / "configs/qwen3_30b_a3b_gspo.yaml"), "model.hf_dir=/nonexistent"])


@pytest.mark.parametrize("config, servers", [("qwen3_30b_a3b_gspo_async.yaml", 2),
                                             ("qwen3_30b_a3b_gspo_async_1node.yaml", 1)])
def test_the_async_configs_keep_no_more_requests_in_flight_than_the_kv_cache_runs(config, servers, capsys):
    """The 30B async config's 256 running requests per server had KV room (262,144 tokens) for
    ~30 at full length: the rest queued. Its budget is the planner's own figure now."""
    nodes, hf = GPU_CONFIGS[config]
    result = _plan(config, nodes=nodes, hf=hf)
    assert load_config(REPO / "configs" / config).rollout.max_total_tokens <= result["engine_kv_cache_tokens"]
    assert result["kv_requests_per_server"] >= result["requests_per_server"] > 200
    assert result["requests_in_flight"] == servers * (result["requests_per_server"] - 1)
    assert main(["--config", str(REPO / "configs" / config), "--nodes", str(nodes), "--hf-config", str(hf)]) == 0
    assert f"in flight: up to {result['requests_in_flight']} requests" in capsys.readouterr().out


def test_a_kv_budget_over_what_the_gpu_holds_is_refused():
    with pytest.raises(ConfigError, match=r"^rollout.max_total_tokens 9,000,000: more KV cache than an engine GPU"):
        _plan("qwen3_30b_a3b_gspo_async.yaml", ["rollout.max_total_tokens=9000000"], nodes=2)


def test_routed_experts_are_counted_as_uint8_per_rank_share(capsys):
    """Qwen3-30B-A3B's 128 experts fit a byte. At 512 responses of 512 + 8192 tokens, 48 layers,
    top-8: rank 0 holds the batch and its requests in flight; each trainer rank gets its
    data-parallel share (DP 8 on one node: 64 responses) of its stage's layers (PP 1: all 48)."""
    assert "routing_per_rank_gb" not in _plan()
    result = _plan(overrides=["rollout.return_routed_experts=true"])
    row = (512 + 8192) * 8  # bytes per layer of a response
    assert result["routing_per_rank_gb"] == pytest.approx(512 / result["data_parallel"] * row * 48 / GIB)
    held = 512 + result["requests_in_flight"]
    assert result["routing_rank0_host_gb"] == pytest.approx(held * row * 48 / GIB)
    assert main(["--config", str(REPO / "configs/qwen3_30b_a3b_gspo.yaml"), "--hf-config", str(HF_30B),
                 "rollout.return_routed_experts=true"]) == 0
    assert "routed experts (rollout.return_routed_experts)" in capsys.readouterr().out


def test_an_engine_that_cannot_do_what_the_config_asks_is_refused_by_the_planner(monkeypatch):
    """The planner asks the config's engine (Engine.check_config) before anything else."""
    from gspo_mcore.engines.vllm.engine import VLLMEngine

    _plan("qwen3_30b_a3b_gspo_vllm.yaml")  # colocated, CUDA IPC: vLLM's ipc transfer engine

    def refuse(config):
        raise ConfigError(f"weight_sync.method: {config.weight_sync.method!r}: not on this engine")

    monkeypatch.setattr(VLLMEngine, "check_config", classmethod(lambda cls, config: refuse(config)))
    with pytest.raises(ConfigError, match="weight_sync.method: 'tensor': not on this engine"):
        _plan("qwen3_30b_a3b_gspo_vllm.yaml")
    _plan()  # SGLang's


def test_vllms_push_receive_buffers_are_counted_on_its_gpus():
    """vLLM receives each bucket into a fresh buffer that its layerwise reload keeps until the
    layer is complete; with 4 expert shards sending interleaved, up to 2 x 4 buckets live at once
    on an engine GPU. Split: they come out of the KV cache's room (the async 1-node vLLM config's
    KV room is the planner's at 256 MB buckets, over it at 1 GiB); colocated: in the weight-push
    phase. A load from disk and SGLang hold none in this count."""
    vllm = "qwen3_30b_a3b_gspo_async_1node_vllm.yaml"
    small = _plan(vllm, ["weight_sync.bucket_mb=256"])
    assert small["engine_push_buffers_gb"] == 2 * 4 * 0.25
    disk = _plan(vllm, ["weight_sync.bucket_mb=256", "weight_sync.method=disk"])
    assert disk["engine_push_buffers_gb"] == 0
    kv_per_token = disk["engine_kv_bytes_per_token"]
    assert disk["engine_kv_cache_tokens"] - small["engine_kv_cache_tokens"] == pytest.approx(2 * GIB / kv_per_token, abs=2)
    with pytest.raises(ConfigError, match=r"rollout.max_total_tokens 2,246,656: more KV cache than an engine GPU holds"):
        _plan(vllm, ["weight_sync.bucket_mb=1024"])
    colocated = _plan("qwen3_30b_a3b_gspo_vllm.yaml")
    as_sglang = _plan("qwen3_30b_a3b_gspo_vllm.yaml", ["weight_sync.method=disk"])
    buffers = colocated["engine_push_buffers_gb"]
    assert buffers == 2 * 8 * colocated_bucket_gb() and as_sglang["engine_push_buffers_gb"] == 0
    assert colocated["phases_gb"]["weight push"] == pytest.approx(as_sglang["phases_gb"]["weight push"] + buffers)


def colocated_bucket_gb() -> float:
    return load_config(REPO / "configs/qwen3_30b_a3b_gspo_vllm.yaml", []).weight_sync.bucket_mb / 1024


PRECISION_AWARE = ["optimizer.cpu_offload=false", "optimizer.precision_aware=true"]


def test_the_precision_aware_optimizer_holds_6_bytes_a_parameter_on_the_gpu():
    """bf16 moments (2 + 2) and the master weights' 16 low bits (2) against fp32 master weights
    and moments (12), sharded alike; gradients and weights unchanged."""
    arch = load_hf_config(HF_30B)
    counts = param_counts(arch)
    plain = _plan("qwen3_30b_a3b_gspo_2node.yaml", [*FP32_ADAM, "weight_sync.check_every=0",
                                                     "rollout.max_total_tokens=65536"], nodes=2)
    aware = _plan("qwen3_30b_a3b_gspo_2node.yaml", [*PRECISION_AWARE, "weight_sync.check_every=0",
                                                     "rollout.max_total_tokens=65536"], nodes=2)
    # DP 16 for the dense part, expert-DP 2 for the experts (EP 8)
    assert aware["trainer_optimizer_gb"] == pytest.approx((counts["dense"] / 16 + counts["experts"] / 8 / 2) * 6 / GIB)
    assert plain["trainer_optimizer_gb"] == pytest.approx(2 * aware["trainer_optimizer_gb"])
    assert aware["trainer_gradients_gb"] == plain["trainer_gradients_gb"] and "host_optimizer_gb_per_gpu" not in aware
    # saved: fp32 moments, the master weights' 16-bit remainders, the bf16 weights (2 + 8 + 2 against 2 + 8 + 4)
    assert aware["checkpoint_gb"] == pytest.approx(plain["checkpoint_gb"] * 12 / 14)


def test_an_offloading_plan_names_the_precision_aware_optimizer_where_it_fits(capsys):
    """One node offloaded (the 30B configs before #47 item 5): the precision-aware optimizer fits on
    the GPUs, the gradient buffers given back while the engine generates, at a smaller KV room (the
    line, with the plan at that room itself: the shipped configs' optimizer); on a 62 GiB GPU the
    training phase alone is over it (no line)."""
    one = _plan(overrides=OFFLOADED)
    room = one["precision_aware_kv_room_tokens"]
    direct = _plan(overrides=[f"rollout.max_total_tokens={room}"])  # the config's own optimizer now
    assert direct["trainer_optimizer_gb"] > 0 and "host_optimizer_gb_per_gpu" not in direct
    assert 0 < room < one["kv_room_tokens"] and direct["kv_room_tokens"] == room
    assert one["precision_aware_fits"] and one["precision_aware_margin_gb"] == pytest.approx(direct["margin_gb"])
    assert direct["margin_gb"] >= KV_ROOM_MARGIN_GB
    assert one["precision_aware_optimizer_gb"] == pytest.approx(direct["trainer_optimizer_gb"])
    assert one["precision_aware_tightest_phase"] == direct["tightest_phase"]
    docs = (REPO / "docs/08-gpu.md").read_text()
    assert f"precision-aware at a KV room of\n{room:,} tokens" in docs
    small = _plan(overrides=[*OFFLOADED, "rollout.max_total_tokens=65536"], gpu_gb=62.0)
    assert not small["precision_aware_fits"] and small["precision_aware_margin_gb"] < 0
    assert "precision_aware_margin_gb" not in direct  # offered to offloading configs only
    line = "faster where it fits: optimizer.precision_aware: true, optimizer.cpu_offload: false fits"
    args = ["--config", "configs/qwen3_30b_a3b_gspo.yaml", "--hf-config", str(HF_30B)]
    code, out, _ = _plan_cli([*args, *OFFLOADED], capsys)
    assert code == 0
    assert f"{line} (bf16 Adam moments on the GPU, {direct['trainer_optimizer_gb']:.1f} GiB per GPU; margin " \
           f"{direct['margin_gb']:.1f} GiB at the {direct['tightest_phase']} phase with rollout.max_total_tokens " \
           f"{room:,}, its KV room, and optimizer.offload_grad_buffers: true): Megatron-Bridge measures CPU offload " \
           "at 1.9-4.2x the step time on Qwen3-30B-A3B" in out.splitlines()
    code, out, _ = _plan_cli(args, capsys)
    assert code == 0 and line not in out


def test_a_code_reward_is_planned_in_cpu_seconds_and_tests_per_second():
    """#38: the sandbox's CPU per step, harness-only and bounded by every test at its CPU limit;
    a group in one sandbox starts once per group; no line for other rewards."""
    from gspo_mcore.config import load_config
    from gspo_mcore.planner.costs import SANDBOX_START_S, SANDBOX_TEST_S, code_reward_estimate

    config = load_config(REPO / "configs" / "qwen3_30b_a3b_gspo_code.yaml")
    t, code = config.train, config.reward.code
    responses = t.rollout_batch_size * t.group_size
    got = code_reward_estimate(config)
    harness = responses / t.group_size * SANDBOX_START_S + responses * code.max_train_tests * SANDBOX_TEST_S
    assert got["code_reward_core_s"] == pytest.approx(harness)
    assert got["code_reward_core_s_bound"] == pytest.approx(harness + responses * code.max_train_tests * code.cpu_s)
    assert got["code_reward_wall_s"] == pytest.approx(harness / config.reward.workers)
    unbatched = code_reward_estimate(load_config(REPO / "configs" / "qwen3_30b_a3b_gspo_code.yaml",
                                                 ["reward.batched=false", "reward.name=code"]))
    assert unbatched["code_reward_core_s"] > got["code_reward_core_s"]
    assert code_reward_estimate(load_config(REPO / "configs" / "qwen3_30b_a3b_gspo.yaml")) == {}


ASYNC = "qwen3_30b_a3b_gspo_async.yaml"  # rollout.mode async, bf16 (strict exactness off: auto)


def _train_flops(config: str, overrides=()) -> dict:
    from gspo_mcore.planner.costs import flops_per_step

    return flops_per_step(load_config(REPO / "configs" / config, list(overrides)), load_hf_config(HF_30B), 512)


def _one_more_forward(base: dict, got: dict, config: str, epochs: int = 1) -> bool:
    """`got`'s hardware count makes one forward of the batch more than `base`'s; the model count
    (the update's 6N + attention per token per epoch) is the same."""
    from gspo_mcore.planner.flops import forward_flops
    from gspo_mcore.planner.memory_model import response_tokens

    cfg = load_config(REPO / "configs" / config)
    seq_len = 512 + response_tokens(cfg)
    forward = forward_flops(load_hf_config(HF_30B), [seq_len] * (cfg.train.rollout_batch_size * cfg.train.group_size))
    return (got["train_tflops"] - base["train_tflops"] == pytest.approx(sum(forward.values()) / 1e12)
            and got["train_model_tflops"] == pytest.approx(base["train_model_tflops"]))


@pytest.mark.parametrize("overrides, passes", [
    ((), {"proximal": 1}),  # loss.proximal recompute, the default: pi_prox from a forward of the batch
    (["train.recompute_old_logprobs=true"], {"proximal": 1}),  # pi_old is pi_prox's forward: no second one
    (["train.strict_exactness=true"], {"proximal": 1}),  # the strict check reads the same forward
    (["loss.proximal=first_minibatch", "train.strict_exactness=true"], {"strict_exactness": 1}),
])
def test_flops_count_the_proximal_forward_of_the_asynchronous_modes(overrides, passes):
    base, got = _train_flops(ASYNC, ["loss.proximal=first_minibatch"]), _train_flops(ASYNC, overrides)
    assert base["train_forward_passes"] == {} and got["train_forward_passes"] == passes
    assert _one_more_forward(base, got, ASYNC)


def test_flops_count_the_kl_references_forward():
    base, got = _train_flops("qwen3_30b_a3b_gspo.yaml"), _train_flops("qwen3_30b_a3b_gspo.yaml", ["loss.kl_loss_coef=0.01"])
    assert base["train_forward_passes"] == {} and got["train_forward_passes"] == {"reference": 1}
    assert _one_more_forward(base, got, "qwen3_30b_a3b_gspo.yaml")
    both = _train_flops(ASYNC, ["loss.kl_loss_coef=0.01"])  # the proximal forward and the reference's
    assert both["train_forward_passes"] == {"proximal": 1, "reference": 1}


@pytest.mark.parametrize("overrides, passes", [
    (["train.strict_exactness=true"], {"strict_exactness": 1}),
    (["train.recompute_old_logprobs=true"], {"old_logprobs": 1}),
    (["train.recompute_old_logprobs=true", "train.strict_exactness=true"], {"old_logprobs": 1}),  # one forward, both
])
def test_flops_count_the_strict_exactness_and_recomputed_old_logprobs_forwards(overrides, passes):
    base, got = _train_flops("qwen3_30b_a3b_gspo.yaml"), _train_flops("qwen3_30b_a3b_gspo.yaml", overrides)
    assert got["train_forward_passes"] == passes and _one_more_forward(base, got, "qwen3_30b_a3b_gspo.yaml")
    epochs = _train_flops("qwen3_30b_a3b_gspo.yaml", [*overrides, "train.ppo_epochs=2"])
    assert _one_more_forward(_train_flops("qwen3_30b_a3b_gspo.yaml", ["train.ppo_epochs=2"]), epochs,
                             "qwen3_30b_a3b_gspo.yaml", epochs=2)


def test_the_plan_says_which_forwards_its_flops_count(capsys):
    code, out, _ = _plan_cli(["--config", f"configs/{ASYNC}", "--nodes", "2", "--hf-config", str(HF_30B),
                              "loss.kl_loss_coef=0.01"], capsys)
    assert code == 0 and "hardware (the update; forwards of the batch: proximal, reference)" in out


# ------------------------------------------------------------------ #45: the estimate, honest
def _memory(config="qwen3_30b_a3b_gspo.yaml", overrides=(), hf=HF_30B) -> dict:
    """memory_estimate for a config on one GPU (no layout refusal in the way)."""
    from gspo_mcore.planner.memory_model import check_layout, memory_estimate

    cfg, arch = load_config(REPO / "configs" / config, list(overrides)), load_hf_config(hf)
    return memory_estimate(cfg, arch, check_layout(cfg, arch, 1, 8), 512)


def test_float32_activations_and_logits_are_twice_bfloat16s():
    """#45: the byte counts assumed 2 bytes a value whatever model.dtype said."""
    bf16, fp32 = _memory(overrides=[*OFFLOADED, *LOGITS]), _memory(overrides=[*OFFLOADED, *LOGITS, "model.dtype=float32"])
    chunk = DEFAULT_CHUNK_ELEMENTS * 4 / GIB  # gspo.logprobs' float32 chunk: float32 either way
    assert fp32["trainer_activations_gb"] == pytest.approx(2 * bf16["trainer_activations_gb"])
    assert fp32["trainer_stored_activations_gb"] == pytest.approx(2 * bf16["trainer_stored_activations_gb"])
    assert fp32["trainer_logits_gb"] - chunk == pytest.approx(2 * (bf16["trainer_logits_gb"] - chunk))
    probe = 512 + 8192
    assert bf16["trainer_check_forward_gb"] == pytest.approx((probe * 2048 * 2 + probe * 151936 * 2 * 2) / GIB + chunk)


@pytest.mark.parametrize("config, nodes, hf, peak_at", [("qwen3_30b_a3b_gspo.yaml", 1, HF_30B, "logits"),
                                                        ("qwen3_235b_a22b_gspo.yaml", 16, HF_235B, "layer backward")])
def test_the_logits_and_a_layers_backward_count_the_larger_not_their_sum(config, nodes, hf, peak_at):
    """The logits are freed once the output layer's backward is done, before any layer's: the
    training peak is the static state, the stored activations and the larger of the two (the 30B's
    logits over a 151,936 vocabulary; the 235B's split over TP 4 while its layers are wider)."""
    got = _plan(config, LOGITS, nodes=nodes, hf=hf)
    static = got["trainer_weights_gb"] + got["trainer_gradients_gb"] + got["trainer_optimizer_gb"]
    stored, logits = got["trainer_stored_activations_gb"], got["trainer_logits_gb"]
    layer = got["trainer_activations_gb"] - stored
    assert got["trainer_peak_at"] == peak_at
    assert got["trainer_total_gb"] == pytest.approx(static + stored + max(layer, logits))
    assert got["trainer_total_gb"] < static + stored + layer + logits - 1  # the old sum, GiBs over
    # the sync check's forward: the hidden states and the larger of a layer and the logits
    from gspo_mcore.planner.memory_model import _layer_bytes_per_token, logits_bytes

    cfg, arch = load_config(REPO / "configs" / config, LOGITS), load_hf_config(hf)
    probe, tp = 512 + cfg.rollout.max_new_tokens, cfg.distributed.tensor_parallel
    want = probe * 2 * arch.hidden_size + max(probe * _layer_bytes_per_token(cfg, arch), logits_bytes(arch, probe, tp))
    assert got["trainer_check_forward_gb"] == pytest.approx(want / GIB)


def test_the_busiest_expert_rank_takes_the_imbalance_factor(monkeypatch):
    """EP 8: the received copies and their FFN tensors at EXPERT_IMBALANCE x the mean; EP 1: one
    rank receives every copy, so no more than the mean; a factor of 1 is the balanced count."""
    from gspo_mcore.planner import memory_model
    from gspo_mcore.planner.memory_model import EXPERT_IMBALANCE, _layer_bytes_per_token, expert_imbalance

    arch = load_hf_config(HF_30B)
    ep8, ep1 = (load_config(REPO / "configs/qwen3_30b_a3b_gspo.yaml", [f"distributed.expert_parallel={ep}"])
                for ep in (8, 1))
    assert EXPERT_IMBALANCE == 2.0 and expert_imbalance(ep8, arch) == 2.0 and expert_imbalance(ep1, arch) == 1.0
    h, k, f = 2048, 8, 768
    attention = 2 * (4 * h + 32 * 128 + 2 * 4 * 128 + 32 * 128)
    assert _layer_bytes_per_token(ep8, arch) == pytest.approx(attention + 2 * k * (h + 2 * (h + 3 * f)))
    assert _layer_bytes_per_token(ep1, arch) == pytest.approx(attention + 2 * k * (2 * h + 3 * f))
    monkeypatch.setattr(memory_model, "EXPERT_IMBALANCE", 1.0)
    assert _layer_bytes_per_token(ep8, arch) == _layer_bytes_per_token(ep1, arch)


def test_the_gpu_checks_arms_are_planned_at_the_logits_peak():
    """launch/gpu_check.py section 3's shape (30B widths, 2 layers, 4 x 4,096 tokens, bf16, EP 1, full
    recompute): weights 3.5 + fp32 gradients 7.0 GiB, then on the logits path the two bf16 logits
    copies (9.3 GiB) over the recomputed layer and its gradients (4.2): 19.9 GiB offloaded, 40.8
    with Adam on the GPU (was 24.1 and 45.0, the sum of the two); with the fused log-probs (the
    check's default) one vocabulary block, the hidden states' and the output weight's gradients
    (1.0 GiB) under the layer's backward: 14.8 and 35.6."""
    from checkpoint_convert.synthetic import QWEN3_30B_A3B
    from gspo_mcore.megatron.qwen3_moe.hf_config import parse_hf_config
    from gspo_mcore.planner.memory_model import check_layout, memory_estimate

    arch = parse_hf_config({**QWEN3_30B_A3B, "num_hidden_layers": 2})
    check = ["model.mcore_dir=null", "model.spec=local", "distributed.expert_parallel=1", "train.num_minibatches=1",
             "train.rollout_batch_size=1", "train.group_size=4", "train.max_tokens_per_microbatch=16384",
             "rollout.max_new_tokens=4000", "weight_sync.method=disk", "rollout.num_servers=1", "rollout.engine_tp=1"]
    planned = {}
    for path, switch in (("logits", LOGITS), ("fused", [])):
        for arm, extra in (("offload", OFFLOADED), ("gpu_adam", FP32_ADAM)):
            cfg = load_config(REPO / "configs/qwen3_30b_a3b_gspo.yaml", [*check, *extra, *switch])
            planned[path, arm] = memory_estimate(cfg, arch, check_layout(cfg, arch, 1, 1), 96)
    assert planned["logits", "offload"]["trainer_peak_at"] == "logits"
    assert planned["fused", "offload"]["trainer_peak_at"] == "layer backward"
    assert [round(planned[key]["trainer_total_gb"], 1) for key in planned] == [19.9, 40.8, 14.8, 35.6]


def test_the_fused_log_probs_count_one_block_and_the_two_gradients():
    """model.fused_logprobs (gspo.logprobs._FusedLinearLogprobs): in training one vocabulary block's
    logits and float32 temporaries, the hidden states' float32 gradient and the output weight's
    gradient, never [tokens, vocabulary]; the sync check's forward only the block."""
    from gspo_mcore.planner.memory_model import FUSED_BYTES_PER_BLOCK_LOGIT

    arch = load_hf_config(HF_30B)
    fused, logits = _memory(), _memory(overrides=LOGITS)
    tokens, h, v = 16384, arch.hidden_size, arch.vocab_size
    block = DEFAULT_CHUNK_ELEMENTS * FUSED_BYTES_PER_BLOCK_LOGIT
    assert fused["trainer_logits_gb"] == pytest.approx((block + tokens * h * 4 + v * h * 2) / GIB)
    assert logits["trainer_logits_gb"] == pytest.approx((v * tokens * 2 * 2 + DEFAULT_CHUNK_ELEMENTS * 4) / GIB)
    probe = 512 + 8192
    assert fused["trainer_check_forward_gb"] == pytest.approx(
        (probe * h * 2 + max(block, probe * _layer_bytes(arch))) / GIB)
    assert fused["trainer_total_gb"] < logits["trainer_total_gb"] - 2  # the peak moves to a layer backward


def _layer_bytes(arch) -> float:
    from gspo_mcore.planner.memory_model import _layer_bytes_per_token

    return _layer_bytes_per_token(load_config(REPO / "configs/qwen3_30b_a3b_gspo.yaml"), arch)


# ------------------------------------------------------------------ #45 item 7: KV room, save time
@pytest.mark.parametrize("config", sorted(GPU_CONFIGS))
def test_the_shipped_configs_kv_room_is_the_planners(config):
    """rollout.max_total_tokens is memory_model.kv_room_tokens' figure for the config (the 30B
    config's 262,144 held 58 requests in flight where ~170 fit): a change to the planner's model
    that moves it shows here, with the value to write."""
    from gspo_mcore.planner.memory_model import check_layout, kv_room_tokens

    nodes, hf = GPU_CONFIGS[config]
    cfg, arch = load_config(REPO / "configs" / config), load_hf_config(hf)
    room = kv_room_tokens(cfg, arch, check_layout(cfg, arch, nodes, 8), H100_GB, 512)
    assert cfg.rollout.max_total_tokens == room, f"configs/{config}: set rollout.max_total_tokens: {room}"


def test_the_kv_room_leaves_the_stated_margin_colocated_and_the_engines_share_split():
    """Colocated: one granule more than the room takes the margin under KV_ROOM_MARGIN_GB; split:
    the room is what check_kv_budget allows, rounded down."""
    from gspo_mcore.planner.memory_model import KV_ROOM_GRANULE_TOKENS

    base = _plan()
    room = base["kv_room_tokens"]
    over = _plan(overrides=[f"rollout.max_total_tokens={room + KV_ROOM_GRANULE_TOKENS}"])
    assert base["margin_gb"] >= KV_ROOM_MARGIN_GB > over["margin_gb"]
    assert base["requests_in_flight"] > 150  # 2 servers x ~87 full-length requests, one kept each
    split = _plan(ASYNC, nodes=2)
    assert split["engine_kv_cache_tokens"] - KV_ROOM_GRANULE_TOKENS < split["kv_room_tokens"] \
        <= split["engine_kv_cache_tokens"]


def test_the_preemption_window_is_torchruns_wait_inside_slurms_warning():
    from gspo_mcore.planner.costs import PREEMPTION_WINDOW_S
    from gspo_mcore.run.torchrun import with_signal_defaults

    args = with_signal_defaults([], {})
    assert int(args[args.index("--shutdown-timeout") + 1]) == PREEMPTION_WINDOW_S == 540
    for script in (REPO / "launch/slurm").glob("*.sbatch"):
        assert "#SBATCH --signal=B:USR1@600" in script.read_text(), script  # the lead covers the wait


def test_a_checkpoint_save_longer_than_the_preemption_window_is_warned(capsys):
    """Save time = the checkpoint over the trainer's nodes at the stated write rate (the precision-aware
    optimizer's 366 GB on one node at 1 GB/s: 366 s of 540, no warning; at 0.5 GB/s 733 s: warned)."""
    from gspo_mcore.planner.costs import CHECKPOINT_WRITE_GB_S

    one, two = _plan(), _plan("qwen3_30b_a3b_gspo_2node.yaml", nodes=2)
    assert CHECKPOINT_WRITE_GB_S == 1.0
    assert one["checkpoint_save_s"] == pytest.approx(one["checkpoint_gb"] / 1.0) and 360 < one["checkpoint_save_s"] < 540
    assert two["checkpoint_save_s"] == pytest.approx(two["checkpoint_gb"] / 2 / 1.0)  # two trainer nodes
    big = _plan("qwen3_235b_a22b_gspo.yaml", nodes=16, hf=HF_235B)  # 12 trainer nodes of 16
    assert big["checkpoint_node_gb"] == pytest.approx(big["checkpoint_gb"] / 12)
    args = ["--config", str(REPO / "configs/qwen3_30b_a3b_gspo.yaml"), "--hf-config", str(HF_30B)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "a checkpoint's save: ~366 s (~366 GB a trainer node at 1 GB/s" in out and "preemption warning" not in out
    assert main([*args, "--checkpoint-write-gb-s", "0.5"]) == 0
    assert "preemption warning: a checkpoint's save: ~733 s" in capsys.readouterr().out
    with pytest.raises(ConfigError, match=r"^--checkpoint-write-gb-s 0: must be > 0$"):
        main([*args, "--checkpoint-write-gb-s", "0"])


# ------------------------------------------------------------------ #45 item 5: the offloaded Adam's host time
def test_host_adam_seconds_are_params_times_the_three_parts():
    from gspo_mcore.planner.host_adam import HostAdamFigures

    figures = HostAdamFigures(copy_to_host_ns_per_param=0.2, copy_back_ns_per_param=0.3,
                              cpu_step_ns_per_param={2: 4.0, 16: 1.0}, source="hand")
    assert figures.step_seconds(3e9, 2) == pytest.approx(3e9 * (0.2 + 4.0 + 0.3) / 1e9)
    assert figures.cpu_step_ns(16) == 1.0
    assert figures.cpu_step_ns(4) == pytest.approx(4.0 * (4 / 2) ** (math.log(1 / 4) / math.log(8)))  # log-log
    assert figures.cpu_step_ns(1) == 8.0  # fewer threads than measured: slower in proportion
    assert figures.cpu_step_ns(64) == 1.0  # more: no faster (memory-bound)


def test_the_plan_prints_the_offloads_host_time_and_warns_past_the_stated_fraction(tmp_path, capsys):
    """The offloaded shard per GPU x ns/param, per optimizer step and per training step
    (minibatches x epochs), at --host-cores-per-gpu; a measured line from --host-adam replaces the
    built-in figures; past OFFLOAD_WARN_FRACTION of the update's time, a warning."""
    from gspo_mcore.planner.host_adam import BUILT_IN, OFFLOAD_WARN_FRACTION
    from gspo_mcore.planner.memory_model import check_layout, optimizer_params_per_gpu

    cfg, arch = load_config(REPO / "configs/qwen3_30b_a3b_gspo.yaml", OFFLOADED), load_hf_config(HF_30B)
    params = optimizer_params_per_gpu(cfg, arch, check_layout(cfg, arch, 1, 8))
    assert params / 1e9 == pytest.approx(3.82, abs=0.01)  # 30B at EP 8: the G5 note's figure
    built_in = plan(cfg, arch, 1, 8, H100_GB, 512, host_cores_per_gpu=2)
    step = params * (BUILT_IN.copy_to_host_ns_per_param + BUILT_IN.cpu_step_ns(2) + BUILT_IN.copy_back_ns_per_param) / 1e9
    assert built_in["host_adam_optimizer_step_s"] == pytest.approx(step)
    assert built_in["host_adam_training_step_s"] == pytest.approx(4 * step)  # 4 minibatches, 1 epoch
    epochs = plan(load_config(REPO / "configs/qwen3_30b_a3b_gspo.yaml", [*OFFLOADED, "train.ppo_epochs=2"]), arch, 1, 8, H100_GB,
                  512, host_cores_per_gpu=2)
    assert epochs["host_adam_training_step_s"] == pytest.approx(8 * step)
    measured = tmp_path / "gpu_check.jsonl"  # the check's --out file: other lines, then the host-Adam one
    measured.write_text("not json\n" + json.dumps({"section": 2, "result": "PASS"}) + "\n" + json.dumps(
        {"section": "host_adam", "copy_to_host_ns_per_param": 0.2, "copy_back_ns_per_param": 0.2,
         "cpu_step_ns_per_param": {"2": 5.0, "16": 0.5}, "source": "H100 node, measured"}) + "\n")
    args = ["--config", str(REPO / "configs/qwen3_30b_a3b_gspo.yaml"), "--hf-config", str(HF_30B)]
    assert main([*args, "--host-adam", str(measured), "--host-cores-per-gpu", "2", *OFFLOADED]) == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["host_adam_optimizer_step_s"] == pytest.approx(params * 5.4 / 1e9)
    assert result["host_adam_source"] == "H100 node, measured" and "[H100 node, measured]" in out
    assert result["host_adam_fraction"] > OFFLOAD_WARN_FRACTION and "offload warning: the host's Adam adds" in out
    assert main([*args, "--host-adam", str(measured), "--host-cores-per-gpu", "16", *OFFLOADED]) == 0
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-1])["host_adam_optimizer_step_s"] == pytest.approx(params * 0.9 / 1e9)
    assert "offload warning" not in out
    assert "host_adam_optimizer_step_s" not in _plan(overrides=["optimizer.cpu_offload=false",
                                                                "optimizer.precision_aware=true"], nodes=1,
                                                     gpu_gb=200.0)  # no offload, no host time


@pytest.mark.parametrize("line, error", [
    ({"copy_to_host_ns_per_param": 0.5, "cpu_step_ns_per_param": {"2": 1.0}}, "its line lacks copy_back_ns_per_param"),
    ({"copy_to_host_ns_per_param": 0.5, "copy_back_ns_per_param": -1, "cpu_step_ns_per_param": {"2": 1.0}},
     "copy_back_ns_per_param -1 is not a positive number"),
    ({"copy_to_host_ns_per_param": 0.5, "copy_back_ns_per_param": 0.5, "cpu_step_ns_per_param": {"two": 1.0}},
     r"cpu_step_ns_per_param\['two'\] = 1.0: threads must be a positive integer"),
    ({"copy_to_host_ns_per_param": 0.5, "copy_back_ns_per_param": 0.5, "cpu_step_ns_per_param": {}},
     "cpu_step_ns_per_param must map threads to ns"),
    ({"section": 2}, "no JSON line with copy_to_host_ns_per_param"),
])
def test_a_bad_host_adam_line_is_one_error_naming_the_file_and_field(tmp_path, line, error):
    from gspo_mcore.planner.host_adam import load_figures

    path = tmp_path / "host_adam.json"
    path.write_text(json.dumps(line) + "\n")
    with pytest.raises(ConfigError, match=rf"^--host-adam {path}: {error}"):
        load_figures(path)
    with pytest.raises(ConfigError, match=rf"^--host-adam {tmp_path / 'none.json'}: "):
        load_figures(tmp_path / "none.json")


# ------------------------------------------------------------------ #47 item 5: the optimizer on the GPUs
def test_the_optimizer_modes_per_gpu_against_a_hand_count():
    """30B at EP 8 on one node, per GPU: the weights and fp32 gradients of the parameters it holds
    (the dense ~1.54B whole, TP 1; 1/8 of the ~29B expert ones), the optimizer over its
    distributed shard (dense over DP 8, experts over expert-DP 1): fp32 Adam 12 bytes (master + 2
    moments), precision-aware 6 (2 + 2 bf16 moments + 2 bits of master remainder), offloaded 0 on
    the GPU (16 on the host with the pinned gradient copy). With the gradient buffers given back,
    the push, check and rollout phases hold no gradients; training holds them either way."""
    counts = param_counts(load_hf_config(HF_30B))
    assert counts["experts"] == 48 * 128 * 3 * 2048 * 768
    local, shard = counts["dense"] + counts["experts"] / 8, counts["dense"] / 8 + counts["experts"] / 8
    assert (local / 1e9, shard / 1e9) == (pytest.approx(5.16, abs=0.01), pytest.approx(3.82, abs=0.01))
    small_kv = ["rollout.max_total_tokens=65536"]  # every mode fits beside it: the terms, not the room
    fp32 = _plan(overrides=[*FP32_ADAM, "train.max_tokens_per_microbatch=4096", *small_kv], gpu_gb=120.0)
    offloaded = _plan(overrides=[*OFFLOADED, *small_kv])
    aware = _plan(overrides=small_kv)  # the config's own: precision-aware, gradients given back
    kept = _plan(overrides=[*small_kv, "optimizer.offload_grad_buffers=false"])
    for result in (fp32, offloaded, aware, kept):
        assert result["trainer_weights_gb"] == pytest.approx(local * 2 / GIB)
        assert result["trainer_gradients_gb"] == pytest.approx(local * 4 / GIB)
    assert fp32["trainer_optimizer_gb"] == pytest.approx(shard * 12 / GIB)
    assert aware["trainer_optimizer_gb"] == kept["trainer_optimizer_gb"] == pytest.approx(shard * 6 / GIB)
    assert offloaded["trainer_optimizer_gb"] == 0
    assert offloaded["host_optimizer_gb_per_gpu"] == pytest.approx(shard * 16 / GIB)
    # 9.6 + 19.2 + 21.3 GiB static while training, 9.6 + 21.3 beside the engine
    assert (round(aware["trainer_static_gb"], 1), round(aware["trainer_gradients_gb"], 1)) == (50.2, 19.2)
    engine = aware["engine_resident_gb"]
    assert aware["phases_gb"]["rollout"] == pytest.approx(aware["trainer_static_gb"] - aware["trainer_gradients_gb"]
                                                          + engine)
    assert kept["phases_gb"]["rollout"] == pytest.approx(kept["trainer_static_gb"] + engine)
    assert aware["phases_gb"]["training"] == kept["phases_gb"]["training"]
    for phase in ("weight push", "sync check", "rollout"):
        assert kept["phases_gb"][phase] - aware["phases_gb"][phase] == pytest.approx(local * 4 / GIB)
    # SGD: one momentum buffer beside the fp32 master weights
    sgd = _plan(overrides=[*FP32_ADAM, "optimizer.name=sgd", "train.max_tokens_per_microbatch=4096", *small_kv],
                gpu_gb=120.0)
    assert sgd["trainer_optimizer_gb"] == pytest.approx(shard * 8 / GIB)


@pytest.mark.parametrize("config", ["qwen3_30b_a3b_gspo.yaml", "qwen3_30b_a3b_gspo_2node.yaml",
                                    "qwen3_30b_a3b_gspo_vllm.yaml"])
def test_the_30b_configs_precision_aware_default_fits_with_the_margin(config):
    """The 30B colocated configs' optimizer (precision-aware, gradient buffers given back) fits at
    the planner's KV room with KV_ROOM_MARGIN_GB free in every phase and the training phase under
    the GPU by more than that; the room holds at least 50 full-length requests a server (one node
    loses ~12% of it against the offloaded optimizer, which keeps the GPUs idle ~15 s a step)."""
    from gspo_mcore.planner.memory_model import check_layout, kv_room_tokens

    nodes = GPU_CONFIGS[config][0]
    cfg, arch = load_config(REPO / "configs" / config), load_hf_config(HF_30B)
    assert cfg.optimizer.precision_aware and cfg.optimizer.offload_grad_buffers and not cfg.optimizer.cpu_offload
    room = kv_room_tokens(cfg, arch, check_layout(cfg, arch, nodes, 8), H100_GB, 512)
    at_room = _plan(config, [f"rollout.max_total_tokens={room}"], nodes=nodes)
    assert at_room["margin_gb"] >= KV_ROOM_MARGIN_GB
    assert at_room["usable_gb"] - at_room["phases_gb"]["training"] > KV_ROOM_MARGIN_GB
    assert at_room["kv_requests_per_server"] >= 50
    offloaded = _plan(config, [*OFFLOADED, "rollout.max_total_tokens=65536"], nodes=nodes)  # rooms apart from it
    assert offloaded["precision_aware_kv_room_tokens"] == room  # the planner's own offer, taken
    assert 0.8 * offloaded["kv_room_tokens"] < room <= 1.5 * offloaded["kv_room_tokens"]


def test_a_code_rewards_timeout_under_its_groups_honest_run_is_warned():
    """configs/qwen3_30b_a3b_gspo_code.yaml's group of 8 correct programs runs all 16 tests each
    (a pass never stops early) at up to 4 s of CPU, after a C++ build of up to 10 s: 592 s. Its old
    reward.timeout_s 300 zeroed such groups; the planner says so, and the recipe's 600 is quiet."""
    from gspo_mcore.planner.cli import reward_lines

    recipe = REPO / "configs/qwen3_30b_a3b_gspo_code.yaml"
    config = load_config(recipe)
    assert config.reward.code.group_seconds(8) == 8 * (16 * 4.0 + 10.0) == 592
    assert reward_lines(config) == []
    (line,) = reward_lines(load_config(recipe, ["reward.timeout_s=300"]))
    assert line.startswith("reward warning: reward.timeout_s 300 s is under what 8 correct programs of one call "
                           "may take, 592 s")
    python_only = load_config(recipe, ["reward.timeout_s=300", "reward.batched=false",
                                       "reward.name=gspo_mcore.rewards.code:code_reward", "reward.code.languages=[python]"])
    assert python_only.reward.code.group_seconds(1) == 64 and reward_lines(python_only) == []
    assert reward_lines(load_config(None, ["reward.timeout_s=1"])) == []  # not a code reward
