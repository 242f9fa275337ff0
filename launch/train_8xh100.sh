#!/usr/bin/env bash
# GSPO on one 8xH100 node: the engine's servers (rollout.engine) + the Megatron-Core trainer (torchrun).
#
#   launch/train_8xh100.sh CONFIG OUTPUT_DIR [key=value ...]
#
# The mode follows the config (checked by `python -m gspo_mcore.planner.cli` before any GPU is used):
# - colocated (weight_sync.colocate: true): rollout.num_servers x rollout.engine_tp servers
#   tile all GPUs; they release their memory while the trainer trains on all GPUs and
#   resume it for the weight push;
# - split (colocate: false): the servers take the first num_servers x engine_tp GPUs, the
#   trainer the rest.
# Logs: OUTPUT_DIR/logs/<engine>_<i>.log (rollout.engine: sglang_0.log, ...), OUTPUT_DIR/logs/torchrun/ (one per rank).
# A checkpoint in OUTPUT_DIR means --resume. Everything started here is stopped on exit.
# SIGUSR1 (Slurm's time-limit warning) makes the trainer save its last completed step and stop.
# Colocated configs need the GPUs in compute mode Default (checked with nvidia-smi).
# Environment: GSPO_PYTHON (python), GSPO_GPUS_PER_NODE (8), GSPO_BASE_PORT (30000),
# GSPO_SERVER_TIMEOUT (900 s); OMP_NUM_THREADS (default: the node's cores over its ranks,
# set by gspo_mcore.run.torchrun).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=launch/lib.sh
source "$here/lib.sh"

if (($# < 2)); then
    echo "usage: $0 CONFIG OUTPUT_DIR [key=value ...]" >&2
    exit 2
fi
config=$1 out=$2
shift 2
py=${GSPO_PYTHON:-python}
gpus=${GSPO_GPUS_PER_NODE:-8}
base_port=${GSPO_BASE_PORT:-30000}
timeout=${GSPO_SERVER_TIMEOUT:-900}
trap gspo_teardown EXIT INT TERM
trap 'gspo_log "SIGUSR1 before training started: stopping"; exit 138' USR1
# The servers take requests only with this run's key (the trainer sends it).
GSPO_ENGINE_API_KEY=${GSPO_ENGINE_API_KEY:-$("$py" -c 'import secrets; print(secrets.token_hex(16))')}
export GSPO_ENGINE_API_KEY

# The planner's breakdown goes to stderr (this log); a refused plan stops here with its one-line error.
plan=$("$py" -m gspo_mcore.planner.cli --config "$config" --gpus-per-node "$gpus" --shell "$@")
eval "$plan"
if ((GSPO_COLOCATE)); then gspo_check_compute_mode || exit 2; fi
mkdir -p "$out/logs"

urls=()
if ((GSPO_EXTERNAL_SERVERS == 0)); then
    for ((i = 0; i < GSPO_NUM_SERVERS; i++)); do
        first=$((i * GSPO_ENGINE_TP))
        port=$((base_port + i))
        CUDA_VISIBLE_DEVICES=$(seq -s, "$first" $((first + GSPO_ENGINE_TP - 1))) \
            gspo_start "$out/logs/${GSPO_ENGINE}_$i.log" "$py" -m gspo_mcore.engines.serve --config "$config" \
            --port "$port" "$@"
        urls+=("http://127.0.0.1:$port")
    done
    for i in "${!urls[@]}"; do
        gspo_wait_healthy "${urls[$i]}" "$timeout" "${GSPO_PIDS[$i]}"
    done
fi

if ((GSPO_COLOCATE)); then
    trainer_devices=$(seq -s, 0 $((gpus - 1)))
else
    trainer_devices=$(seq -s, "$GSPO_ROLLOUT_GPUS" $((gpus - 1)))
fi
resume=()
if [[ -f $out/checkpoints/latest ]]; then
    resume=(--resume)
fi
server_list=()
if ((${#urls[@]})); then
    server_list=("rollout.urls=[$(IFS=,; echo "${urls[*]}")]")
fi

gspo_log "trainer on GPUs $trainer_devices"
CUDA_VISIBLE_DEVICES=$trainer_devices "$py" -m gspo_mcore.run.torchrun --standalone \
    --nproc_per_node "$GSPO_TRAINER_GPUS" --log-dir "$out/logs/torchrun" --redirects 3 --tee 3 \
    -m gspo_mcore.train --config "$config" --output-dir "$out" "${resume[@]}" "$@" "${server_list[@]}" &
trainer=$!
gspo_forward_usr1 "$trainer"
gspo_wait "$trainer"
