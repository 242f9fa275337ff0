#!/usr/bin/env bash
# Convert Qwen3-30B-A3B from Hugging Face format to Megatron-Core torch_dist, then verify.
#
#   launch/convert_qwen3_30b.sh HF_DIR OUT_DIR
#
# Streams one layer at a time (no GPU, ~1 GB of RAM); bf16 stays bf16. The output is what
# Megatron-LM `--load` and this project's trainer read. `verify` compares every tensor
# (it holds two float32 copies: ~250 GB of RAM for 30B; skip it with GSPO_SKIP_VERIFY=1).
set -euo pipefail
if (($# != 2)); then
    echo "usage: $0 HF_DIR OUT_DIR" >&2
    exit 2
fi
hf=$1 out=$2
py=${GSPO_PYTHON:-python}
"$py" -m checkpoint_convert hf-to-mcore --hf-dir "$hf" --output-dir "$out" --dtype bf16 --spec te
if [[ ${GSPO_SKIP_VERIFY:-0} != 1 ]]; then
    # verify compares logits with transformers on the CPU (local spec): keep it off the GPUs.
    CUDA_VISIBLE_DEVICES="" "$py" -m checkpoint_convert verify --hf-dir "$hf" --mcore-dir "$out"
fi
