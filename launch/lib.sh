#!/usr/bin/env bash
# Shared by the launch scripts: start processes in their own process groups, wait for an
# HTTP /health, and tear everything down on exit or failure (no orphaned servers).
# Source it, then `trap gspo_teardown EXIT INT TERM`.

GSPO_PIDS=()

# gspo_container_command REPO OUTPUT_DIR: sets GSPO_IN_CONTAINER to what runs a job step inside
# the job's container (empty: none), placed between srun's own options and the command.
# GSPO_CONTAINER_IMAGE names the image: for pyxis/enroot (srun --container-image; the default
# runtime) a registry image such as `nvcr.io#org/gspo-mcore:gpu` or a .sqsh file, for
# apptainer (GSPO_CONTAINER=apptainer) a .sif. The repository and OUTPUT_DIR are mounted at
# their own paths, so every path the scripts use holds inside; GSPO_CONTAINER_MOUNTS adds more
# (src:dst[,src:dst], e.g. /models:/models). The job's environment passes into the container.
# shellcheck disable=SC2034  # GSPO_IN_CONTAINER is the sbatch scripts' to read
gspo_container_command() {
    local repo=$1 out=$2 runtime=${GSPO_CONTAINER:-pyxis} image=${GSPO_CONTAINER_IMAGE:-}
    GSPO_IN_CONTAINER=()
    if [[ -z $image ]]; then
        if [[ -n ${GSPO_CONTAINER:-} ]]; then
            echo "error: GSPO_CONTAINER=$runtime: set GSPO_CONTAINER_IMAGE to the image to run in" >&2
            return 2
        fi
        return 0
    fi
    mkdir -p "$out" && out=$(cd "$out" && pwd)  # a mount needs an absolute path that exists
    local mounts="$repo:$repo,$out:$out${GSPO_CONTAINER_MOUNTS:+,$GSPO_CONTAINER_MOUNTS}"
    case $runtime in
        pyxis) GSPO_IN_CONTAINER=(--container-image="$image" --container-mounts="$mounts" --container-workdir="$repo") ;;
        apptainer) GSPO_IN_CONTAINER=(apptainer exec --nv --bind "$mounts" --pwd "$repo" "$image") ;;
        *)
            echo "error: GSPO_CONTAINER=$runtime: expected pyxis or apptainer" >&2
            return 2
            ;;
    esac
}

gspo_log() {
    printf '[%s] %s\n' "$(date '+%H:%M:%S')" "$*" >&2
}

# gspo_start LOGFILE CMD [ARGS...]: run CMD in the background in a new session (its own
# process group), stdout+stderr to LOGFILE; remembers the PID for gspo_teardown.
gspo_start() {
    local logfile=$1
    shift
    mkdir -p "$(dirname "$logfile")"
    setsid "$@" >"$logfile" 2>&1 &
    GSPO_PIDS+=("$!")
    gspo_log "started pid $! ($1), log: $logfile"
}

# gspo_wait_healthy URL TIMEOUT_S [PID]: poll URL/health until it answers 200; fail with a
# message naming the URL when TIMEOUT_S passes or when PID (the server) exits first.
gspo_wait_healthy() {
    local url=$1 timeout=$2 pid=${3:-}
    local deadline=$((SECONDS + timeout))
    while ((SECONDS < deadline)); do
        if [[ -n $pid ]] && ! kill -0 "$pid" 2>/dev/null; then
            gspo_log "error: server $url exited while starting"
            return 1
        fi
        if curl -sf -o /dev/null --max-time 5 "$url/health"; then
            gspo_log "server $url is healthy"
            return 0
        fi
        sleep 1
    done
    gspo_log "error: server $url not healthy after ${timeout}s"
    return 1
}

# gspo_check_compute_mode: a colocated config puts SGLang and the trainer on the same GPUs,
# two CUDA contexts each, which the compute modes Exclusive_Process (common on shared clusters)
# and Prohibited refuse at the second context. One line and status 2 if any GPU is in such a
# mode; nothing to check without nvidia-smi (the GPU steps report their own errors).
gspo_check_compute_mode() {
    command -v nvidia-smi >/dev/null 2>&1 || return 0
    local mode
    mode=$(nvidia-smi -q -d COMPUTE | awk -F' *: *' '/^ *Compute Mode *:/ && $2 != "Default" {print $2; exit}') || true
    if [[ -n $mode ]]; then
        gspo_log "error: GPU compute mode is $mode, but weight_sync.colocate puts SGLang and the trainer on the same GPUs (two CUDA contexts each): set it to Default (nvidia-smi -c DEFAULT, as root) or use a split config"
        return 2
    fi
}

# gspo_wait PID: wait until PID (a background child) exits and return its status. A trapped
# signal (USR1: Slurm's time-limit warning) interrupts `wait`; this waits again.
gspo_wait() {
    local pid=$1 status
    while true; do
        status=0
        wait "$pid" || status=$?
        if ! kill -0 "$pid" 2>/dev/null; then
            # Gone: when a trap interrupted this last wait, the next one returns its status.
            if ((status > 128)); then status=0; wait "$pid" || status=$?; fi
            return "$status"
        fi
    done
}

# gspo_forward_usr1 PID: pass SIGUSR1 on to PID (torchrun hands it to the trainer ranks, which
# save the last completed step and exit: gspo_mcore.run.preemption).
gspo_forward_usr1() {
    # shellcheck disable=SC2064  # the PID is fixed now
    trap "gspo_log 'SIGUSR1: the trainer saves its last completed step and stops'; kill -USR1 $1 2>/dev/null || true" USR1
}

# gspo_teardown: SIGTERM every started process group, SIGKILL what is left after 10 s.
gspo_teardown() {
    local status=$? pid
    trap - EXIT INT TERM
    for pid in "${GSPO_PIDS[@]}"; do
        kill -TERM -- "-$pid" 2>/dev/null || true
    done
    for _ in $(seq 10); do
        local alive=0
        for pid in "${GSPO_PIDS[@]}"; do
            if kill -0 "$pid" 2>/dev/null; then alive=1; fi
        done
        ((alive)) || break
        sleep 1
    done
    for pid in "${GSPO_PIDS[@]}"; do
        kill -KILL -- "-$pid" 2>/dev/null || true
    done
    GSPO_PIDS=()
    exit "$status"
}
