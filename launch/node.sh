#!/usr/bin/env bash
# One node of a multi-node GSPO job (run once per node by srun; see slurm/gspo_multi_node.sbatch).
#
#   launch/node.sh CONFIG OUTPUT_DIR [key=value ...]
#
# Environment (set by the sbatch template): GSPO_NODES (all hostnames, space-separated, trainer
# nodes first), GSPO_TRAINER_NODES (how many of them train), GSPO_NODE_RANK (this node's
# index; default SLURM_NODEID), MASTER_ADDR, MASTER_PORT, GSPO_PYTHON, GSPO_BASE_PORT (30000), GSPO_SERVER_TIMEOUT,
# GSPO_ENGINE_API_KEY (made per job by the template: the servers listen on their node's address,
# never on every interface, and take requests, weight loads included, only with it); GLOO_SOCKET_IFNAME and OMP_NUM_THREADS
# (default: set by gspo_mcore.run.torchrun, see launch/README.md).
# Rollout nodes (index >= GSPO_TRAINER_NODES) serve SGLang on all their GPUs; with no rollout
# nodes (colocated configs) every node serves and trains. Trainer nodes wait for every
# server, then join torchrun's rendezvous at MASTER_ADDR:MASTER_PORT.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=launch/lib.sh
source "$here/lib.sh"

config=$1 out=$2
shift 2
py=${GSPO_PYTHON:-python}
gpus=${GSPO_GPUS_PER_NODE:-8}
base_port=${GSPO_BASE_PORT:-30000}
timeout=${GSPO_SERVER_TIMEOUT:-1800}
read -r -a nodes <<<"$GSPO_NODES"
trainer_nodes=$GSPO_TRAINER_NODES
rank=${GSPO_NODE_RANK:-$SLURM_NODEID}
host=${nodes[$rank]}
trap gspo_teardown EXIT INT TERM
# Slurm's time-limit warning reaches every node (srun passes it on): the trainer nodes pass it to
# their trainer (below); a rollout node keeps serving until training has ended.
trap 'gspo_log "SIGUSR1: serving until the trainer has saved and stopped"' USR1
GSPO_ENGINE_API_KEY=${GSPO_ENGINE_API_KEY:-${GSPO_SGLANG_API_KEY:-}}  # the key's name before vLLM, still read
export GSPO_ENGINE_API_KEY
if [[ -z ${GSPO_ENGINE_API_KEY:-} ]]; then
    gspo_log "error: GSPO_ENGINE_API_KEY is not set (the sbatch template makes one per job): servers other nodes reach need it"
    exit 2
fi

# A failed plan stops here with the planner's own one-line error (set -e on the assignment);
# inside eval "$(...)" it would surface later as an unbound variable.
plan=$("$py" -m gspo_mcore.planner.cli --config "$config" --nodes "${#nodes[@]}" --gpus-per-node "$gpus" --shell "$@")
eval "$plan"
if ((GSPO_COLOCATE)); then gspo_check_compute_mode || exit 2; fi
# Colocated configs: every node serves and trains. Split: the rollout nodes serve.
rollout_nodes=$((${#nodes[@]} - trainer_nodes))
if ((GSPO_COLOCATE)); then
    if ((rollout_nodes)); then
        gspo_log "error: weight_sync.colocate is true but $rollout_nodes rollout node(s) were allocated"
        exit 2
    fi
    serving=("${nodes[@]}")
else
    if ((GSPO_ROLLOUT_GPUS != rollout_nodes * gpus)); then
        gspo_log "error: rollout.num_servers x engine_tp = $GSPO_ROLLOUT_GPUS GPUs, but $rollout_nodes rollout node(s) have $((rollout_nodes * gpus))"
        exit 2
    fi
    serving=("${nodes[@]:trainer_nodes}")
fi
per_node=$((gpus / GSPO_ENGINE_TP))
# Each node's address as every node names it (launch/addresses.py): its servers listen there only,
# the URLs name it. The same list on every node.
resolved=$("$py" "$here/addresses.py" "${nodes[@]}")  # set -e: a name that does not resolve stops here
mapfile -t addresses <<<"$resolved"
declare -A address_of
for ((n = 0; n < ${#nodes[@]}; n++)); do address_of[${nodes[$n]}]=${addresses[$n]}; done
urls=()
for node in "${serving[@]}"; do
    for ((i = 0; i < per_node; i++)); do urls+=("http://${address_of[$node]}:$((base_port + i))"); done
done
mkdir -p "$out/logs/$host"

if [[ " ${serving[*]} " == *" $host "* ]]; then
    for ((i = 0; i < per_node; i++)); do
        first=$((i * GSPO_ENGINE_TP))
        CUDA_VISIBLE_DEVICES=$(seq -s, "$first" $((first + GSPO_ENGINE_TP - 1))) \
            gspo_start "$out/logs/$host/${GSPO_ENGINE}_$i.log" "$py" -m gspo_mcore.engines.serve --config "$config" \
            --host "${address_of[$host]}" --port $((base_port + i)) "$@"
    done
fi
# Trainer node 0 leaves this on the shared OUTPUT_DIR when training has ended: rollout nodes
# stop then (serving forever would keep the Slurm step, and a requeue, alive after the run).
done_marker="$out/logs/training_done.${SLURM_JOB_ID:-$MASTER_PORT}"
if ((rank >= trainer_nodes)); then
    while [[ ! -e $done_marker ]]; do
        for pid in "${GSPO_PIDS[@]}"; do
            if ! kill -0 "$pid" 2>/dev/null; then
                gspo_log "error: server pid $pid on $host exited before training ended"
                exit 1
            fi
        done
        sleep 5
    done
    gspo_log "training has ended: stopping the servers on $host"
    exit 0
fi
for url in "${urls[@]}"; do
    gspo_wait_healthy "$url" "$timeout"
done
resume=()
if [[ -f $out/checkpoints/latest ]]; then resume=(--resume); fi
"$py" -m gspo_mcore.run.torchrun --nnodes "$trainer_nodes" --node-rank "$rank" --nproc_per_node $((GSPO_TRAINER_GPUS / trainer_nodes)) \
    --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "${SLURM_JOB_ID:-gspo}" \
    --log-dir "$out/logs/$host/torchrun" --redirects 3 --tee 3 \
    -m gspo_mcore.train --config "$config" --output-dir "$out" "${resume[@]}" "$@" \
    "rollout.urls=[$(IFS=,; echo "${urls[*]}")]" weight_sync.master_address=auto &
trainer=$!
gspo_forward_usr1 "$trainer"  # srun passes the job's USR1 to every node's task
status=0
gspo_wait "$trainer" || status=$?
if ((rank == 0)); then touch "$done_marker"; fi
exit "$status"
