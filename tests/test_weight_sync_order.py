"""The order of a push's calls where NCCL would deadlock and gloo cannot show it (gloo blocks the
host; NCCL returns before its data moves): a bucket is settled on its stream before any server
is told to read it."""

import torch

from gspo_mcore.engines.sglang.engine import SGLangEngine
from gspo_mcore.weight_sync import distributed, tensor


class Recorder:
    def __init__(self):
        self.calls = []

    def settle(self, flat):
        self.calls.append("settle")

    def call(self, url, path, body=None):
        self.calls.append(f"post {path}")
        return {}

    def broadcast(self, flat, **kwargs):
        self.calls.append("broadcast")


def test_distributed_sync_settles_the_bucket_before_posting_it(monkeypatch):
    """An expert-only owner posting while its broadcast is queued behind a TP gather rank 0 has
    not enqueued: rank 0 -> server -> owner -> all_gather -> rank 0, a hang on GPUs with TP > 1."""
    record = Recorder()
    monkeypatch.setattr(distributed, "settle", record.settle)
    monkeypatch.setattr(distributed.dist, "broadcast", record.broadcast)
    sync = object.__new__(distributed.DistributedWeightSync)
    sync.dtype, sync.groups = torch.float32, [("http://a", "g0", None), ("http://b", "g1", None)]
    sync.engine = SGLangEngine(["http://a", "http://b"])
    monkeypatch.setattr(sync.engine, "call", record.call)
    sync._send([("w", torch.ones(3)), ("v", torch.zeros(2))])
    # The posts run on a thread beside their broadcasts: only "settled first" is ordered.
    assert record.calls[0] == "settle" and sorted(record.calls[1:]) == [
        "broadcast", "broadcast", "post /update_weights_from_distributed", "post /update_weights_from_distributed"]


def test_tensor_sync_settles_the_broadcast_before_servers_map_the_memory(monkeypatch):
    record = Recorder()
    monkeypatch.setattr(tensor, "settle", record.settle)
    monkeypatch.setattr(tensor.dist, "broadcast", record.broadcast)
    monkeypatch.setattr(tensor.dist, "get_rank", lambda: 0)
    sync = object.__new__(tensor.TensorWeightSync)
    sync.dtype, sync.engine = torch.float32, SGLangEngine(["http://a"])
    sync._load_everywhere = lambda flat, metadata: record.calls.append("post /update_weights_from_tensor")
    sync._share(0, [("w", (3,))], [("w", torch.ones(3))])
    assert record.calls == ["broadcast", "settle", "post /update_weights_from_tensor"]


def test_the_sync_check_keeps_the_other_ranks_waiting_on_the_host_group(monkeypatch):
    """The last stage asks every server over HTTP (queued behind rollouts in an asynchronous run);
    the other ranks waited in an NCCL broadcast_object_list meanwhile (30-minute watchdog)."""
    from gspo_mcore.weight_sync import check

    waits = []

    def on_host(value, src=0):
        waits.append(src)
        return value

    class Engine:
        urls = ["http://a"]

        def prompt_logprobs(self, url, probes):
            return [[-1.0, -2.0] for _ in probes]

    fused = []
    monkeypatch.setattr(check, "sequence_logprobs",
                        lambda model, probes, fused_logprobs: fused.append(fused_logprobs) or [[-1.0, -2.0] for _ in probes])
    monkeypatch.setattr(check, "last_stage_rank", lambda: 0)
    monkeypatch.setattr(check.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(check, "broadcast_from_host", on_host)
    monkeypatch.setattr(check.dist, "broadcast_object_list", lambda *a, **k: (_ for _ in ()).throw(AssertionError))
    stats = check.check_sync(None, Engine(), [[1, 2, 3]], median_tolerance=0.01)
    assert waits == [0] and stats["sync_check_median"] == 0.0
    # the forward as training's: model.fused_logprobs (the planner counts the check's forward so)
    check.check_sync(None, Engine(), [[1, 2, 3]], median_tolerance=0.01, fused_logprobs=True)
    assert fused == [False, True]


def test_a_colocated_push_waits_for_the_servers_on_the_host_group(monkeypatch):
    """While rank 0 opens and closes the update and while the servers load a bucket, the other
    ranks wait. An NCCL barrier would spin a kernel on each GPU meanwhile, the GPUs a colocated
    engine is loading on; gloo waits in a socket read."""
    from gspo_mcore.weight_sync import buckets

    host = object()
    barriers = []
    for module in (buckets, tensor):
        monkeypatch.setattr(module, "host_group", lambda: host)
    monkeypatch.setattr(buckets.dist, "barrier", lambda group=None, **kwargs: barriers.append(group))
    monkeypatch.setattr(buckets.dist, "get_rank", lambda: 1)  # a rank that only waits
    monkeypatch.setattr(tensor.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(tensor.dist, "all_gather_object", lambda out, obj, **kwargs: out.__setitem__(slice(None), [obj] * 2))

    class Engine:
        def shared_payload(self, flat, layout, dtype):
            return "handle"

    sync = object.__new__(tensor.TensorWeightSync)
    sync.dtype, sync.engine, sync.posts = torch.float32, Engine(), []
    with buckets.update_session(Engine(), "step-1"):
        sync._load_everywhere(torch.ones(3), [("w", (3,))])
    assert barriers == [host] * 4
