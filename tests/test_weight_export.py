"""The trainer's weights leave as Hugging Face tensors, each exactly once across all ranks,
bitwise equal to what was loaded, in bounded buckets, under every parallel layout."""

import pytest
import torch

from gspo_mcore.common.safetensors_io import HFCheckpointReader
from conftest import LAYOUTS, plan_layout_job
from gspo_mcore.weight_sync import bucketed

BUCKET_BYTES = 100_000  # as in tests/workers/jobs.py
EXPORT_LAYOUTS = ["EP2", "PP2", "TP2-SP", "TP2-SP-ETP2", "DP2"]
SAVE_LAYOUTS = ["EP2", "PP2", "TP2-SP"]
plan_layout_job("export_owned", "export_owned", EXPORT_LAYOUTS)
plan_layout_job("save_hf", "save_hf", SAVE_LAYOUTS)


@pytest.mark.parametrize("layout", EXPORT_LAYOUTS)
def test_each_tensor_exported_once(tiny_hf_dir, layout_output, layout):
    nproc, _ = LAYOUTS[layout]
    out = layout_output(layout, "export_owned")
    reader = HFCheckpointReader(tiny_hf_dir)
    names = []
    for rank in range(nproc):
        for bucket in torch.load(out / f"rank{rank}.pt"):
            sizes = [t.numel() * t.element_size() for _, t in bucket]
            assert sum(sizes) <= BUCKET_BYTES or len(bucket) == 1
            for name, tensor in bucket:
                names.append(name)
                assert torch.equal(tensor, reader[name]), name
    assert sorted(names) == sorted(reader.keys())  # every tensor, none twice


def test_bucketed_keeps_order_and_bound():
    tensors = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 30, 5, 100, 1, 1])]
    buckets = list(bucketed(tensors, bucket_bytes=40 * 4))
    assert [[n for n, _ in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3"], ["t4", "t5"]]
    assert [pair for b in buckets for pair in b] == tensors


@pytest.mark.parametrize("layout", SAVE_LAYOUTS)
def test_save_hf_checkpoint_from_sharded_model(tiny_hf_dir, layout_output, layout):
    out = layout_output(layout, "save_hf") / "hf"
    original, exported = HFCheckpointReader(tiny_hf_dir), HFCheckpointReader(out)
    assert sorted(exported.keys()) == sorted(original.keys())
    assert all(torch.equal(exported[n], original[n]) for n in original.keys())
    assert (out / "config.json").read_text() == (tiny_hf_dir / "config.json").read_text()
    assert not list(out.parent.glob("*.tmp-*"))


def test_colocated_servers_read_from_the_trainer_rank_on_their_gpu():
    """The tensor method's map (server TP rank -> trainer rank on the same GPU), whatever order
    the rendezvous gave the trainer ranks, and one-line errors for layouts it cannot serve."""
    from gspo_mcore.common.errors import WeightSyncError
    from gspo_mcore.weight_sync import colocated_readers

    # Two 8-GPU hosts; the rendezvous numbered node-b's ranks first.
    ranks = [({"node-b"}, gpu) for gpu in range(8)] + [({"node-a", "10.0.0.1"}, gpu) for gpu in range(8)]
    urls = ["http://node-a:30000", "http://node-a:30001", "http://node-b:30000", "http://node-b:30001"]
    assert colocated_readers(urls, [4] * 4, ranks) == [[8, 9, 10, 11], [12, 13, 14, 15], [0, 1, 2, 3], [4, 5, 6, 7]]
    # By address as well as by name; on one host the loopback address is that host.
    assert colocated_readers(["http://10.0.0.1:1", "http://10.0.0.1:2"], [4, 4], ranks[8:]) == [[0, 1, 2, 3],
                                                                                                [4, 5, 6, 7]]
    assert colocated_readers(["http://127.0.0.1:1"], [8], ranks[8:]) == [list(range(8))]
    with pytest.raises(WeightSyncError, match="no trainer rank has LOCAL_RANK 8 there"):
        colocated_readers(["http://node-a:1", "http://node-a:2", "http://node-a:3"], [4, 4, 4], ranks[8:])
    with pytest.raises(WeightSyncError, match="loopback address but the trainer spans 2 hosts"):
        colocated_readers(["http://127.0.0.1:1"], [8], ranks)
    with pytest.raises(WeightSyncError, match="do not cover the 8 trainer ranks"):
        colocated_readers(["http://node-a:1"], [4], ranks[8:])
