"""SGLang 0.5.23 behind the `Engine` interface, with every capability (process groups, colocated
shared memory, disk, memory release, the sync check's probe): its control endpoints (weight
updates, versions, cache, memory, pause), its launch command, its memory model and its
weight-transfer layout (the "flattened_bucket": a bucket's tensors' bytes concatenated in order)."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from gspo_mcore.engines.base import Engine
from gspo_mcore.engines.capabilities import (DiskLoad, MemoryRelease, ProcessGroupPush, SharedMemoryPush, SyncProbe,
                                             dtype_name)
from gspo_mcore.engines.sglang.client import SGLangClient
from gspo_mcore.engines.sglang.process_group import weight_update_group
from gspo_mcore.engines.sglang.server import server_for_config
from gspo_mcore.common.errors import WeightSyncError
from gspo_mcore.common.netaddr import address_towards, listening_store


def _status_ok(answer: dict) -> bool:
    return answer.get("status") == "ok"


class SGLangEngine(Engine, ProcessGroupPush, SharedMemoryPush, DiskLoad, MemoryRelease, SyncProbe):
    name = "sglang"
    client_class = SGLangClient
    # Beside the weights and the KV cache (CUDA graphs, activations, allocator slack).
    MARGIN_GB = 4.0
    # --mem-fraction-static's default share of a GPU for weights and KV cache, less a little.
    USABLE_FRACTION = 0.85

    @classmethod
    def launch_command(cls, config, port: int, host: str = "127.0.0.1",
                       api_key: str | None = None) -> tuple[list[str], dict]:
        return server_for_config(config, port, host, api_key)

    def __init__(self, urls: list[str], timeout_s: float = 600.0, api_key: str | None = None):
        super().__init__(urls, timeout_s, api_key)
        self._stores: dict[str, object] = {}  # weight group name -> its TCPStore (kept alive with the group)

    # ---------------------------------------------------------------- HTTP
    def call(self, url: str, path: str, body: dict | None = None) -> dict:
        """POST `body` as JSON to url+path; the answer as a dict ({"text": ...} for a plain-text
        200); an answer of success false is a WeightSyncError with SGLang's message."""
        answer = self.request(url, path, body)
        if isinstance(answer, str):
            return {"text": answer}  # /flush_cache answers with text
        if isinstance(answer, dict) and answer.get("success") is False:
            raise WeightSyncError(f"server {url}{path}: {answer.get('message', answer)}")
        return answer if isinstance(answer, dict) else {"result": answer}

    # ---------------------------------------------------------------- the servers
    def server_info(self, url: str) -> dict:
        """The server's /get_server_info: its launch arguments and scheduler state."""
        answer = self.request(url, "/get_server_info", None, "GET")  # GET only in SGLang
        if not isinstance(answer, dict):
            raise WeightSyncError(f"server {url}/get_server_info: not a server description: {str(answer)[:200]!r}")
        return answer

    def healthy(self, url: str) -> bool:
        return self.answers(url, "/health")  # 200 with an empty body

    def tp_size(self, url: str) -> int:
        info = self.server_info(url)
        try:
            return int(info.get("tp_size", 1))
        except (TypeError, ValueError):
            raise WeightSyncError(f"server {url}/get_server_info: no tp_size in {str(info)[:200]!r}") from None

    def capacity(self, url: str, default: int, request_tokens: int = 0) -> int:
        """Requests the server runs at once without queueing one: its --max-running-requests (else
        the scheduler's effective limit, SGLang 0.5.23's
        internal_states[i].effective_max_running_requests_per_dp, else `default`), and no more than
        its KV pool (`max_total_num_tokens`, from the scheduler's start-up info) holds at
        `request_tokens` each: past that SGLang queues or retracts requests for room."""
        info = self.server_info(url)
        states = info.get("internal_states") or [{}]
        running = default
        for value in (info.get("max_running_requests"), states[0].get("effective_max_running_requests_per_dp")):
            if isinstance(value, int) and value > 0:
                running = value
                break
        pool = info.get("max_total_num_tokens")
        if request_tokens > 0 and isinstance(pool, int) and pool > 0:
            running = min(running, max(1, pool // request_tokens))
        return running

    # ---------------------------------------------------------------- generation
    def prefill_logprobs(self, url: str, sequence: list[int]) -> list:
        """/generate with `logprob_start_len` 0: meta_info's input_token_logprobs ([log-prob, id, text] each)."""
        answer = self.call(url, "/generate", {"input_ids": sequence, "return_logprob": True, "logprob_start_len": 0,
                                              "sampling_params": {"max_new_tokens": 1, "temperature": 1.0}})
        entries = answer.get("meta_info", {}).get("input_token_logprobs") or []
        return [e[0] for e in entries[1:]]  # the first token has no log-prob

    def pause(self, keep_tokens: bool = True) -> None:
        """`keep_tokens` (rollout.partial): running requests are retracted, keeping their generated
        tokens and log-probs (SGLang 0.5.23's `retract` mode: Scheduler.retract_all /
        Req.reset_for_retract keep output_ids and the logprob lists), their /generate calls stay
        open. Otherwise they are aborted (mode `abort`: TokenizerManager.pause_generation aborts
        all and waits until none runs) and the client starts them over. Either way weight loads
        then need no wait."""
        # SGLang 0.5.23 (entrypoints/http_server.py pause_generation / continue_generation) answers
        # {"message": ..., "status": "ok"} once the scheduler has retracted (or aborted) everything.
        self.on_all_checked("/pause_generation", {"mode": "retract" if keep_tokens else "abort"}, _status_ok,
                            "expected status ok (generation paused)")

    def resume(self) -> None:
        """Retracted requests are prefilled again (prompt + the tokens so far, under the new
        weights; the earlier tokens keep their log-probs) and continue: Req.reset_for_retract
        drops their routed experts (srt/managers/schedule_batch.py), so all of a continued
        response's are its last token's version's (the `Engine` invariant)."""
        self.on_all_checked("/continue_generation", {"torch_empty_cache": False}, _status_ok,
                            "expected status ok (generation continued)")

    # ---------------------------------------------------------------- colocated memory
    def release_memory(self) -> None:
        self.on_all("/release_memory_occupation")

    def resume_memory(self) -> None:
        self.on_all("/resume_memory_occupation")

    # ---------------------------------------------------------------- weight updates
    # The session: SGLang 0.5.23 refuses weight loads outside it (HTTP 400).
    def begin_update(self) -> None:
        self.on_all("/begin_weight_update")

    def end_update(self, weight_version: str) -> None:
        """Close the session, tag what comes next `weight_version`, drop the prefix cache: each
        answer checked, each a precondition of the engine's log-probs being the new weights'
        (SGLang 0.5.23: end_weight_update {"success": true}; update_weight_version {"success": true,
        "new_version": V}; /flush_cache's text "Cache flushed..." with 200, 400 when
        Scheduler.flush_cache found requests running, which `request` raises)."""
        self.on_all_checked("/end_weight_update", None, lambda a: a.get("success") is True,
                            "expected success true (weight-update session closed)")
        # Requests in flight (asynchronous modes: paused, retracted) keep going: never abort them.
        self.on_all_checked("/update_weight_version", {"new_version": weight_version, "abort_all_requests": False},
                            lambda a: a.get("success") is True and a.get("new_version") == weight_version,
                            f"expected success true and new_version {weight_version!r}")
        # Cached prefixes hold KV of the old weights. While paused (retract mode) SGLang flushes
        # with retracted requests waiting (Scheduler.is_fully_idle(ignore_waiting=paused)).
        self.on_all_checked("/flush_cache", None, lambda a: a.get("text", "").startswith("Cache flushed"),
                            "expected 'Cache flushed'")

    def load_from_disk(self, hf_dir, weight_version: str) -> None:
        """The load flushes the server's cache and tags what it generates from now on."""
        self.on_all("/update_weights_from_disk", {"model_path": str(hf_dir), "weight_version": weight_version})

    def open_weight_group(self, url: str, name: str, master_address: str, backend: str, timeout_s: float):
        """SGLang's `init_custom_process_group` on our side (process_group.py: without importing
        SGLang), `/init_weights_update_group` on the server's (its TP workers are ranks 1..tp). Our
        own store, not a tcp:// init_method: under torchrun that would connect to the elastic
        agent's store instead of hosting one (TORCHELASTIC_USE_AGENT_STORE); it listens on that one
        address only."""
        world_size = 1 + self.tp_size(url)
        if master_address == "auto":  # multi-node: the address this rank reaches the server from
            master_address = address_towards(urlparse(url).hostname)
        store = listening_store(master_address, world_size, timedelta(seconds=timeout_s))
        body = {"master_address": master_address, "master_port": store.port, "rank_offset": 1,
                "world_size": world_size, "group_name": name, "backend": backend}
        with ThreadPoolExecutor(max_workers=1) as pool:
            answer = pool.submit(self.call, url, "/init_weights_update_group", body)
            # The servers wrap the store in a PrefixStore named after the group; so do we.
            group = weight_update_group(backend, dist.PrefixStore(name, store), world_size, 0, name,
                                        timedelta(seconds=timeout_s))
            answer.result()
        self._stores[name] = store  # the group needs its store alive
        return group

    def close_weight_group(self, url: str, name: str, group) -> None:
        try:
            self.call(url, "/destroy_weights_update_group", {"group_name": name})
        except WeightSyncError:
            pass
        dist.destroy_process_group(group)
        self._stores.pop(name, None)

    def post_bucket(self, url: str, name: str, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """The bucket's names, dtypes and shapes, read off the flattened bucket it receives."""
        self.call(url, "/update_weights_from_distributed", {
            "names": [n for n, _ in bucket], "dtypes": [dtype_name(t.dtype) for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket], "flush_cache": False, "load_format": "flattened_bucket",
            "group_name": name})

    def broadcast(self, group, flat: torch.Tensor) -> None:
        dist.broadcast(flat, group_src=0, group=group)

    def prepare_sharing(self, on_gpu: bool) -> None:
        if on_gpu:
            from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

            # CUDA IPC handles name the device by UUID: the servers number their GPUs differently.
            monkey_patch_torch_reductions()
        else:
            # Rebuildable by path in any process (the default passes file descriptors only to
            # processes of the same multiprocessing family).
            torch.multiprocessing.set_sharing_strategy("file_system")

    def shared_payload(self, flat: torch.Tensor, layout: list[tuple[str, tuple[int, ...]]],
                       dtype: torch.dtype) -> str:
        from sglang.srt.utils import MultiprocessingSerializer  # heavy (SGLang): the colocated method only
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

        metadata, start = [], 0
        for name, shape in layout:
            size = math.prod(shape) * dtype.itemsize
            metadata.append(FlattenedTensorMetadata(name=name, shape=torch.Size(shape), dtype=dtype,
                                                    start_idx=start, end_idx=start + size, numel=size))
            start += size
        return MultiprocessingSerializer.serialize({"flattened_tensor": flat, "metadata": metadata}, output_str=True)

    def load_shared(self, url: str, payloads: list[str]) -> None:
        self.call(url, "/update_weights_from_tensor", {"serialized_named_tensors": payloads,
                                                       "load_format": "flattened_bucket", "flush_cache": False})

