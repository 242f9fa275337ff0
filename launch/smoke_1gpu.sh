#!/usr/bin/env bash
# Checks on one H100 before a cluster job, in order; each prints one verdict line (PASS / FAIL),
# and the first failure stops the script (its log is named).
#
#   launch/smoke_1gpu.sh [WORK_DIR]        (default runs/smoke_1gpu; must not exist yet)
#
# 0/3 launch/gpu_check.py, the check that needs no image (run it alone first on a bare machine:
#     docs/08-gpu.md): imports, the 30B layer shapes' parity, one GSPO update against the
#     planner's memory, save and resume, the CUDA-IPC and NCCL push calls; one JSON line per
#     section, in WORK_DIR/0_gpu_check.log. GSPO_WHEELS names a wheel folder (launch/wheelhouse.sh)
#     if the image lacks a package.
# 1/3 parity: a random tiny Qwen3-MoE in bf16, converted with --spec te, its logits under the
#     Transformer Engine spec in bf16 against transformers' (float32 compute on the same bf16
#     weights). Passes at mean |difference| <= 0.1 x the logits' std and top-1 agreement >= 0.9
#     (bf16 rounding flips some router near-ties, so the maximum is no criterion; a wrong
#     mapping gives ~1 x std) with the exported weights bitwise the checkpoint's.
# 2/3 colocated: the toy task on one GPU shared by SGLang (memory saver) and the trainer
#     (configs/qwen3_30b_a3b_gspo.yaml's path: weights over CUDA IPC, Megatron's precision-aware
#     Adam on Transformer Engine's FusedAdam, the fp32 gradient buffers given back while SGLang
#     generates), the sync check after every push; 2 steps, then a resume for a third. Then the
#     offloaded arm (Adam in host memory, Megatron's HybridDeviceOptimizer: the 235B and one-node
#     async configs'), 2 steps.
# 3/3 memory: a 2-layer synthetic model with Qwen3-30B-A3B's widths (128 experts, hidden 2048,
#     vocabulary 151,936) at the 30B config's token budget, colocated as in 2/3: the attention
#     backend Transformer Engine chose, and the trainer's peak memory (metrics.jsonl
#     peak_memory_gb) beside the planner's estimate: passes within the planner's stated
#     tolerance (gspo_mcore.planner.cli.ESTIMATE_TOLERANCE, 1.5x). No checkpoint is saved.
# Disk: ~30 GB under WORK_DIR/gpu_check (0/3's synthetic model and its save with Adam's states),
#     ~4 GB more (3/3's synthetic model, ~3.7 GB; the toy model and runs' logs),
#     all kept for reading the logs: remove WORK_DIR when done.
# Environment: GSPO_PYTHON (python). Logs: WORK_DIR/*.log and each run's logs/.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
py=${GSPO_PYTHON:-python}
work=${1:-runs/smoke_1gpu}
[[ $work == /* ]] || work=$PWD/$work
cd "$here/.."  # the repository: configs/ and launch/ by relative path
config=configs/qwen3_30b_a3b_gspo.yaml

if ! command -v nvidia-smi >/dev/null 2>&1 || ! "$py" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
    echo "error: launch/smoke_1gpu.sh needs a CUDA GPU (nvidia-smi and torch.cuda.is_available())" >&2
    exit 2
fi
if [[ -e $work ]]; then
    echo "error: $work exists: remove it or name another WORK_DIR (a run there would be resumed)" >&2
    exit 2
fi
mkdir -p "$work"

# step VERDICT_PREFIX LOG CMD...: run CMD, its output appended to LOG; a failure is the verdict.
step() {
    local prefix=$1 log=$2
    shift 2
    if ! "$@" >>"$log" 2>&1; then
        echo "FAIL $prefix: $(basename "$1") exited non-zero ($(tail -n 1 "$log" | cut -c1-200)); log: $log"
        exit 1
    fi
}

# ---- 0/3 the bare-machine check, here in the image
log=$work/0_gpu_check.log
if "$py" launch/gpu_check.py --work "$work/gpu_check" ${GSPO_WHEELS:+--wheels "$GSPO_WHEELS"} >"$log" 2>&1; then
    # Section lines only: a section's parts (section 3's arms) carry "part" and are counted in it.
    echo "PASS 0/3 gpu_check: $(grep '"result": "PASS"' "$log" | grep -vc '"part"') sections pass; lines: $log"
else
    echo "FAIL 0/3 gpu_check: $(grep '"result": "FAIL"' "$log" | head -n 1 | cut -c1-300); log: $log"
    exit 1
fi

# ---- 1/3 Transformer Engine spec + bf16 parity with transformers
log=$work/1_parity.log
step "1/3 TE parity" "$log" "$py" -c 'import sys, torch
from gspo_mcore.megatron.qwen3_moe.tiny import make_tiny_checkpoint
make_tiny_checkpoint(sys.argv[1], seed=0, dtype=torch.bfloat16)' "$work/tiny"
step "1/3 TE parity" "$log" "$py" -m checkpoint_convert hf-to-mcore --hf-dir "$work/tiny" \
    --output-dir "$work/tiny-mcore" --dtype bf16 --spec te
step "1/3 TE parity" "$log" "$py" -m gspo_mcore.megatron.parity --config "$config" --mcore-dir "$work/tiny-mcore" --seq-len 64 \
    "model.hf_dir=$work/tiny" distributed.expert_parallel=1
"$py" - "$(grep '^{' "$log" | tail -n 1 || true)" <<'EOF'
import json, sys
try:
    f = json.loads(sys.argv[1])
except ValueError:
    print("FAIL 1/3 TE parity: no figures from gspo_mcore.megatron.parity in its log")
    sys.exit(1)
ok = f["export_bitwise_identical"] and f["mean_abs_logit_diff"] <= 0.1 * f["logit_std"] and f["top1_agreement"] >= 0.9
print(f"{'PASS' if ok else 'FAIL'} 1/3 TE parity (bf16, --spec te): mean |logit diff| {f['mean_abs_logit_diff']:.3g} "
      f"(std {f['logit_std']:.3g}), max {f['max_abs_logit_diff']:.3g}, top-1 agreement {f['top1_agreement']:.3f}, "
      f"export bitwise {f['export_bitwise_identical']}")
sys.exit(not ok)
EOF

# ---- 2/3 colocated: CUDA IPC sync, memory saver, precision-aware Adam with the gradient buffers
#      given back during rollout, sync check every step, resume; then offloaded Adam
log=$work/2_colocated.log
step "2/3 colocated" "$log" "$py" -m gspo_mcore.tasks.toy "$work/toy"
step "2/3 colocated" "$log" "$py" -m checkpoint_convert hf-to-mcore --hf-dir "$work/toy/model" \
    --output-dir "$work/toy-mcore" --dtype bf16 --spec te
# The toy model's head_dim is 32, below what SGLang's default FA3 kernels take: triton attention.
toy=("model.hf_dir=$work/toy/model" "model.mcore_dir=$work/toy-mcore" "data.path=$work/toy/prompts.jsonl" "eval.datasets=[]"
     reward.name=gspo_mcore.tasks.toy:category_reward reward.workers=1 distributed.expert_parallel=1
     rollout.num_servers=1 rollout.engine_tp=1 rollout.max_new_tokens=3 rollout.max_total_tokens=8192
     "rollout.server_args=[--mem-fraction-static,0.3,--enable-memory-saver,--attention-backend,triton]"
     weight_sync.bucket_mb=64 weight_sync.check_every=1 train.rollout_batch_size=16 train.group_size=8
     train.max_tokens_per_microbatch=2048 train.save_every=1 train.export_hf=false)
export GSPO_GPUS_PER_NODE=1
step "2/3 colocated" "$log" launch/train_8xh100.sh "$config" "$work/colocated" "${toy[@]}" train.steps=2
step "2/3 colocated" "$log" launch/train_8xh100.sh "$config" "$work/colocated" "${toy[@]}" train.steps=3  # resumes
# colocated_verdict METRICS [STEPS [ARM]]: the run's steps 1..STEPS (default 3, the last after a
# resume), each with a sync check.
colocated_verdict() {
"$py" - "$@" <<'EOF'
import json, os, sys
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
arm = sys.argv[3] if len(sys.argv) > 3 else "precision-aware Adam, gradient buffers given back"
if not os.path.exists(sys.argv[1]):
    print(f"FAIL 2/3 colocated ({arm}): no {sys.argv[1]}")
    sys.exit(1)
rows = [json.loads(line) for line in open(sys.argv[1])]
checks = [r.get("sync_check_median") for r in rows]
ok = [r["step"] for r in rows] == list(range(1, steps + 1)) and None not in checks
print(f"{'PASS' if ok else 'FAIL'} 2/3 colocated (CUDA IPC sync, memory saver, {arm}): steps "
      f"{[r['step'] for r in rows]}{' (the last after a resume)' if steps == 3 else ''}, sync check medians {checks}")
sys.exit(not ok)
EOF
}
colocated_verdict "$work/colocated/metrics.jsonl"
offload=(optimizer.precision_aware=false optimizer.cpu_offload=true optimizer.offload_grad_buffers=false)
step "2/3 colocated" "$log" launch/train_8xh100.sh "$config" "$work/colocated_offload" "${toy[@]}" "${offload[@]}" \
    train.steps=2 train.save_every=0 train.save_final=false
colocated_verdict "$work/colocated_offload/metrics.jsonl" 2 "offloaded Adam"

# ---- 3/3 memory at Qwen3-30B-A3B's widths and the 30B config's token budget
log=$work/3_memory.log
step "3/3 memory" "$log" "$py" -c 'import sys
from checkpoint_convert.synthetic import QWEN3_30B_A3B, write_synthetic_checkpoint
write_synthetic_checkpoint(sys.argv[1], {**QWEN3_30B_A3B, "num_hidden_layers": 2})' "$work/synthetic"
# Toy prompts (~12 tokens) + 4080 new tokens: 4 sequences fill a 16,384-token microbatch.
memory=("model.hf_dir=$work/synthetic" model.mcore_dir=null "data.path=$work/toy/prompts.jsonl" "eval.datasets=[]"
        "data.tokenizer_dir=$work/toy/model" reward.name=gspo_mcore.tasks.toy:category_reward
        rollout.group_filter=all rollout.max_sampling_rounds=1 distributed.expert_parallel=1 rollout.num_servers=1
        rollout.engine_tp=1 rollout.max_new_tokens=4080 train.rollout_batch_size=4 train.group_size=8
        weight_sync.check_every=1 train.steps=2 train.save_every=0 train.save_final=false train.export_hf=false)
step "3/3 memory" "$log" "$py" -m gspo_mcore.planner.cli --config "$config" --gpus-per-node 1 --prompt-tokens 16 \
    --hf-config "$work/synthetic/config.json" "${memory[@]}"
planned=$(grep '^{' "$log" | tail -n 1)
NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=1 step "3/3 memory" "$log" launch/train_8xh100.sh "$config" "$work/memory" "${memory[@]}"
backend=$(grep -rhoE "Running with [A-Za-z]+ backend( \([^)]*\))?" "$work/memory/logs" | sort -u | paste -sd ';' || true)
"$py" - "$planned" "$work/memory/metrics.jsonl" "${backend:-not reported}" <<'EOF'
import json, sys
plan, rows = json.loads(sys.argv[1]), [json.loads(line) for line in open(sys.argv[2])]
peaks = [r["peak_memory_gb"] for r in rows if r.get("peak_memory_gb") is not None]
# The trainer's own peak as planned: training, the push (bucket) or the check's forward,
# without SGLang's share (another process).
engine = plan.get("engine_resident_gb", 0.0)
planned = max(plan["trainer_total_gb"], *(plan["phases_gb"][p] - engine for p in ("weight push", "sync check")))
# The planner states its estimates hold within ESTIMATE_TOLERANCE of a measurement (gspo_mcore.planner.cli).
tolerance = plan["estimate_tolerance"]
ok = bool(peaks) and max(peaks) <= planned * tolerance
measured = f"{max(peaks):.1f} GiB ({max(peaks) / planned:.2f}x)" if peaks else "not in metrics.jsonl"
print(f"{'PASS' if ok else 'FAIL'} 3/3 memory (2 layers at Qwen3-30B-A3B widths, 16k tokens): attention {sys.argv[3]}; "
      f"trainer peak {measured} vs the planner's {planned:.1f} GiB, tolerance {tolerance:g}x "
      f"(training {plan['trainer_total_gb']:.1f}: "
      f"activations {plan['trainer_activations_gb']:.1f}, logits {plan['trainer_logits_gb']:.1f})")
sys.exit(not ok)
EOF
