"""Our ctypes binding of NCCL (gspo_mcore/engines/vllm/nccl_library.py) and the weight group on it
(nccl.py), without a GPU: the declarations against nccl.h, the unique id's bytes, every failing
ncclResult_t as one line, the library search, the communicator's order of calls (init on the
rank's device, vLLM's warm-up all-reduce, abort on close) with a stand-in for the library; and,
where a libnccl.so.2 is at hand (GSPO_TEST_NCCL_LIBRARY, or the nvidia-nccl wheel beside torch),
the calls NCCL answers without a GPU."""

import ctypes
import os
import threading

import pytest
import torch

from gspo_mcore.engines.vllm import nccl, nccl_library
from gspo_mcore.engines.vllm.nccl_library import NCCLError
from helpers import ERRORS, FakeNCCL

def bound(fake) -> nccl_library.Library:
    return nccl_library.Library(fake, "/fake/libnccl.so.2")


# ------------------------------------------------------------------ declarations and bytes
def test_the_declarations_are_ncclh():
    """ncclUniqueId is 128 bytes and goes to ncclCommInitRank by value; the enums are C ints;
    the data types are nccl.h's numbers; handles and streams are pointers."""
    assert ctypes.sizeof(nccl_library.UniqueId) == nccl_library.UNIQUE_ID_BYTES == 128
    for enum in (nccl_library.Result, nccl_library.DataType, nccl_library.RedOp):
        assert ctypes.sizeof(enum) == 4
    for pointer in (nccl_library.Comm, nccl_library.Stream, nccl_library.Buffer):
        assert ctypes.sizeof(pointer) == ctypes.sizeof(ctypes.c_void_p)
    table = {name: (restype, argtypes) for name, restype, argtypes in nccl_library.FUNCTIONS}
    assert table["ncclCommInitRank"][1][2] is nccl_library.UniqueId  # by value, not a pointer
    assert len(table["ncclBroadcast"][1]) == 7 and len(table["ncclAllReduce"][1]) == 7
    assert {k: nccl_library.DATA_TYPES[k] for k in ("uint8", "float32", "bfloat16")} == \
        {"uint8": 1, "float32": 7, "bfloat16": 9}
    assert nccl_library.SUM == 0


def test_unique_id_bytes_round_trip_every_byte_value():
    for uid in (bytes(range(128)), bytes(range(128, 256)), os.urandom(128)):
        assert nccl_library.id_bytes(nccl_library.id_struct(uid)) == uid
    with pytest.raises(NCCLError, match=r"^an NCCL unique id is 128 bytes, got 127$"):
        nccl_library.id_struct(bytes(127))
    library = bound(FakeNCCL(uid=bytes(range(128, 256))))
    assert library.unique_id() == bytes(range(128, 256)) and library.version() == 23007


# ------------------------------------------------------------------ errors, one line each
CALLS = [("ncclGetVersion", lambda lib: lib.version()),
         ("ncclGetUniqueId", lambda lib: lib.unique_id()),
         ("ncclCommInitRank", lambda lib: lib.comm_init_rank(3, bytes(128), 0)),
         ("ncclAllReduce", lambda lib: lib.all_reduce(0x10, 1, "float32", 0x1000, 0x20)),
         ("ncclBroadcast", lambda lib: lib.broadcast(0x10, 8, "uint8", 0, 0x1000, 0x20)),
         ("ncclCommAbort", lambda lib: lib.comm_abort(0x1000))]


@pytest.mark.parametrize("name, call", CALLS, ids=[name for name, _ in CALLS])
@pytest.mark.parametrize("code", sorted(ERRORS))
def test_every_failing_call_is_one_line_naming_it_and_nccls_words(name, call, code):
    fake = FakeNCCL(codes={name: code}, last_error=b"Cuda failure 'out of memory'\n")
    with pytest.raises(NCCLError) as raised:
        call(bound(fake))
    message = str(raised.value)
    assert message.startswith(f"{name} failed: {ERRORS[code].decode()} (ncclResult_t {code}, /fake/libnccl.so.2)")
    assert message.endswith(": Cuda failure 'out of memory'") and "\n" not in message


def test_an_error_without_more_words_and_a_library_without_last_error():
    fake = FakeNCCL(codes={"ncclCommAbort": 3}, missing=("ncclGetLastError",))
    with pytest.raises(NCCLError, match=r"^ncclCommAbort failed: internal error .* \(ncclResult_t 3, [^)]*\)$"):
        bound(fake).comm_abort(0x1000)
    with pytest.raises(NCCLError, match=r"^/fake/libnccl.so.2: no ncclCommAbort \(an NCCL too old"):
        bound(FakeNCCL(missing=("ncclCommAbort",)))
    with pytest.raises(NCCLError, match=r"^NCCL has no data type for complex64"):
        bound(FakeNCCL()).broadcast(0x10, 8, "complex64", 0, 0x1000, 0x20)


def test_the_library_is_searched_as_vllm_does_and_not_found_is_one_line():
    """VLLM_NCCL_SO_PATH alone when set (the servers load it too); else the soname (the copy torch
    loaded), then the nvidia-nccl wheel's file."""
    tried = []

    def loader(path):
        tried.append(path)
        raise OSError(f"{path}: cannot open shared object file: No such file or directory")

    with pytest.raises(NCCLError) as raised:
        nccl_library.load(env={}, wheel="/w/nvidia/nccl/lib/libnccl.so.2", loader=loader)
    assert tried == ["libnccl.so.2", "/w/nvidia/nccl/lib/libnccl.so.2"] and "\n" not in str(raised.value)
    assert str(raised.value).startswith("no libnccl.so.2 to bind for the weight transfer: tried libnccl.so.2 (")
    tried.clear()
    with pytest.raises(NCCLError, match=r"^VLLM_NCCL_SO_PATH=/mine/libnccl.so.2: cannot load it \(/mine"):
        nccl_library.load(env={"VLLM_NCCL_SO_PATH": "/mine/libnccl.so.2"}, wheel="/w/x.so", loader=loader)
    assert tried == ["/mine/libnccl.so.2"]
    fake = FakeNCCL()
    library = nccl_library.load(env={}, wheel="/w/x.so", loader=lambda path: fake if path == "/w/x.so" else loader(path))
    assert library.cdll is fake and library.path == "/w/x.so"


# ------------------------------------------------------------------ the weight group (nccl.py)
class FakeStream:
    cuda_stream = 0x20

    def __init__(self, log, device=None):
        self.log = log

    def wait_stream(self, other):
        self.log.append(("wait", other))

    def synchronize(self):
        self.log.append(("synchronize",))


class FakeEvent:
    """torch.cuda.Event: recorded on a stream, done once `polls_left` queries have said not yet."""
    polls_left = 0

    def __init__(self, log):
        self.log = log

    def record(self, stream):
        self.log.append(("event", stream))

    def query(self):
        FakeEvent.polls_left -= 1
        return FakeEvent.polls_left < 0


class FakeTensor:
    def __init__(self, device=torch.device("cuda", 3), numel=1, dtype=torch.float32):
        self.device, self._numel, self.dtype = device, numel, dtype

    def data_ptr(self):
        return 0x10

    def numel(self):
        return self._numel

    def record_stream(self, stream):
        stream.log.append(("record", stream))


@pytest.fixture
def on_gpu(monkeypatch):
    """nccl.py's torch.cuda calls, recorded; our library a FakeNCCL."""
    log, fake = [], FakeNCCL()
    monkeypatch.setattr(nccl, "loaded", lambda: bound(fake))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: log.append(("set_device", device)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: FakeStream(log, device))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "current")
    monkeypatch.setattr(torch.cuda, "Event", lambda: FakeEvent(log))
    monkeypatch.setattr(FakeEvent, "polls_left", 0)
    monkeypatch.setattr(torch, "zeros", lambda *shape, dtype=None, device=None: FakeTensor(device, 1, dtype))
    return log, fake


def test_a_group_is_made_on_the_ranks_device_and_warmed_up_as_vllms_workers_expect(on_gpu):
    """Init as rank 0 on the rank's device, then the one-element float32 sum all-reduce
    PyNcclCommunicator._init_comm issues on every worker, on the group's stream, waited for."""
    log, fake = on_gpu
    group = nccl.communicator(3, bytes(range(128)), device=3)
    assert fake.names() == ["ncclCommInitRank", "ncclAllReduce"]
    (_, (_, world_size, uid, rank)), (_, reduce) = fake.calls
    assert (world_size, nccl_library.id_bytes(uid), rank) == (3, bytes(range(128)), 0)
    assert reduce == (0x10, 0x10, 1, nccl_library.DATA_TYPES["float32"], nccl_library.SUM, 0x1000, 0x20)
    assert log == [("set_device", 3), ("wait", "current"), ("synchronize",)]
    assert (group.comm, group.device, group.closed) == (0x1000, 3, False)


def test_a_failed_init_or_warm_up_is_one_line_and_leaves_no_communicator(on_gpu, monkeypatch):
    log, fake = on_gpu
    fake.codes["ncclCommInitRank"] = 6
    with pytest.raises(NCCLError, match=r"^ncclCommInitRank failed: remote process exited"):
        nccl.communicator(3, bytes(128), device=3)
    fake.codes = {"ncclAllReduce": 2}
    with pytest.raises(NCCLError, match=r"^ncclAllReduce failed: unhandled system error"):
        nccl.communicator(3, bytes(128), device=3)
    assert fake.names()[-3:] == ["ncclCommInitRank", "ncclAllReduce", "ncclCommAbort"]


def test_a_broadcast_runs_on_the_groups_own_stream(on_gpu):
    """Queued before the server answers; if it refuses the bucket the broadcast never completes.
    On the group's own stream (after the work that wrote the bucket, its memory kept until it
    ran) it cannot hold up the trainer's later work on the current stream."""
    log, fake = on_gpu
    group = nccl.WeightGroup(0x1000, FakeStream(log), 3, bound(fake))
    nccl.broadcast(group, FakeTensor(numel=4096, dtype=torch.uint8))
    assert log == [("wait", "current"), ("record", group.stream), ("event", group.stream)]
    assert len(group.pending) == 1  # what nccl.wait looks at
    assert fake.calls == [("ncclBroadcast", (0x10, 0x10, 4096, nccl_library.DATA_TYPES["uint8"], 0, 0x1000, 0x20))]
    with pytest.raises(NCCLError, match=r"^ncclBroadcast of a tensor on cuda:0 in a group on cuda:3$"):
        nccl.broadcast(group, FakeTensor(device=torch.device("cuda", 0)))
    nccl.close(group)
    with pytest.raises(NCCLError, match=r"^ncclBroadcast on a closed weight group$"):
        nccl.broadcast(group, FakeTensor())


def test_close_aborts_once_on_the_groups_device_and_never_hangs(on_gpu):
    """A reopen leaks nothing: the communicator is aborted (not destroyed: that waits for peers),
    once however often closed; an abort that fails is one line; one that hangs is left on a
    daemon thread after the wait, as vLLM's PyNcclCommunicator.destroy leaves its own."""
    log, fake = on_gpu
    group = nccl.WeightGroup(0x1000, FakeStream(log), 3, bound(fake))
    nccl.close(group)
    nccl.close(group)
    assert fake.calls == [("ncclCommAbort", (0x1000,))] and group.closed and ("set_device", 3) in log
    failing = nccl.WeightGroup(0x2000, FakeStream(log), 3, bound(FakeNCCL(codes={"ncclCommAbort": 5})))
    with pytest.raises(NCCLError, match=r"^ncclCommAbort failed: invalid usage"):
        nccl.close(failing)
    release, stuck = threading.Event(), FakeNCCL()
    stuck.ncclCommAbort = lambda comm: release.wait(10) and 0
    hanging = nccl.WeightGroup(0x3000, FakeStream(log), 3, bound(stuck))
    try:
        with pytest.raises(NCCLError, match=r"^ncclCommAbort did not return within 0.05 s"):
            nccl.close(hanging, wait_s=0.05)
    finally:
        release.set()


class Clock:
    def __init__(self):
        self.now, self.slept = 0.0, []

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.slept.append(seconds)
        self.now += seconds


def test_wait_returns_when_the_broadcast_ran_and_aborts_first_on_an_error_a_refusal_or_the_deadline(on_gpu):
    """A worker that died mid-broadcast leaves our kernel spinning (and a synchronize behind it): the
    wait polls the broadcast's event and the communicator's async error, and on an NCCL error, the
    server refusing the bucket, or the deadline aborts the communicator, then raises one line
    naming the server."""
    log, fake = on_gpu
    server = "http://10.0.0.7:8000"

    def sent(codes=None):
        group = nccl.WeightGroup(0x1000, FakeStream(log), 3, bound(FakeNCCL(codes=codes)))
        nccl.broadcast(group, FakeTensor())
        return group

    clock = Clock()
    FakeEvent.polls_left = 3
    group = sent()
    nccl.wait(group, server, 60, clock=clock, sleep=clock.sleep)
    assert group.pending == [] and not group.closed and len(clock.slept) == 3
    assert group.library.cdll.names().count("ncclCommGetAsyncError") == 4
    # a peer gone: NCCL's proxy reports it; aborted before the error reaches the caller
    FakeEvent.polls_left = 10**6
    group = sent({"ncclCommGetAsyncError": 0})
    group.library.cdll._ncclCommGetAsyncError = lambda comm, out: setattr(out._obj, "value", 6) or 0
    with pytest.raises(NCCLError) as failed:
        nccl.wait(group, server, 60, clock=clock, sleep=clock.sleep)
    assert str(failed.value) == (f"server {server}: the NCCL weight broadcast failed: remote process exited or there "
                                 "was a network error (ncclResult_t 6); its communicator aborted")
    assert group.closed and group.library.cdll.names()[-1] == "ncclCommAbort"
    # the server refused the bucket: its receive never comes
    group = sent()
    with pytest.raises(NCCLError, match=r"abandoned: the server answered: HTTP 400 .*; its communicator aborted$"):
        nccl.wait(group, server, 60, stop=lambda: "the server answered: HTTP 400 bad shapes", clock=clock,
                  sleep=clock.sleep)
    assert group.closed
    # nothing reported, nothing done: the deadline (NCCL may never see a P2P peer die)
    group, began = sent(), clock.now
    with pytest.raises(NCCLError, match=r"not complete after 30 s \(a worker gone\?\); its communicator aborted$"):
        nccl.wait(group, server, 30, clock=clock, sleep=clock.sleep)
    assert group.closed and 30 <= clock.now - began <= 30 + 2 * nccl.POLL_S
    # an abort that fails too is said in the same line
    group = sent({"ncclCommAbort": 5})
    with pytest.raises(NCCLError, match=r"not complete after 1 s .*; aborting its communicator failed too: "
                                        r"ncclCommAbort failed: invalid usage"):
        nccl.wait(group, server, 1, clock=clock, sleep=clock.sleep)


def test_version_is_the_bound_librarys(monkeypatch):
    monkeypatch.setattr(nccl, "loaded", lambda: bound(FakeNCCL()))
    assert nccl.version() == (2, 30, 7) and nccl.unique_id() == bytes(range(128, 256))


# ------------------------------------------------------------------ a real libnccl.so.2
def real_library() -> str | None:
    return os.environ.get("GSPO_TEST_NCCL_LIBRARY") or nccl.library()


@pytest.mark.skipif(real_library() is None, reason="no libnccl.so.2 here (GSPO_TEST_NCCL_LIBRARY names one)")
def test_a_real_libnccl_answers_what_needs_no_gpu():
    """NCCL itself: its version, two unique ids of 128 bytes that differ (each names a fresh
    bootstrap socket), and, with no GPU, ncclCommInitRank's failure as one line."""
    library = nccl_library.load(env={"VLLM_NCCL_SO_PATH": real_library()})
    major, minor, _ = nccl.decode_version(library.version())
    assert (major, minor) >= (2, 9)
    first, second = library.unique_id(), library.unique_id()
    assert len(first) == len(second) == 128 and first != second
    if not torch.cuda.is_available():
        with pytest.raises(NCCLError) as raised:
            library.comm_init_rank(2, first, 0)
        assert str(raised.value).startswith("ncclCommInitRank failed: ") and "\n" not in str(raised.value)
