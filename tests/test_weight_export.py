"""The trainer's weights leave as Hugging Face tensors, each exactly once across all ranks,
bitwise equal to what was loaded, in bounded buckets, under every parallel layout."""

import pytest
import torch

from checkpoint_convert.safetensors_io import HFCheckpointReader
from conftest import LAYOUTS, run_module
from gspo_mcore.weight_sync import bucketed

BUCKET_BYTES = 100_000  # as in tests/workers/export_owned.py


@pytest.mark.parametrize("layout", ["EP2", "PP2", "TP2-SP", "TP2-SP-ETP2", "DP2"])
def test_each_tensor_exported_once(tiny_hf_dir, tmp_path, layout):
    nproc, overrides = LAYOUTS[layout]
    run_module(["tests/workers/export_owned.py", str(tiny_hf_dir), str(tmp_path), *overrides], nproc=nproc)
    reader = HFCheckpointReader(tiny_hf_dir)
    names = []
    for rank in range(nproc):
        for bucket in torch.load(tmp_path / f"rank{rank}.pt"):
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


@pytest.mark.parametrize("layout", ["EP2", "PP2", "TP2-SP"])
def test_save_hf_checkpoint_from_sharded_model(tiny_hf_dir, tmp_path, layout):
    nproc, overrides = LAYOUTS[layout]
    out = tmp_path / "exported"
    run_module(["tests/workers/save_hf.py", str(tiny_hf_dir), str(out), *overrides], nproc=nproc)
    original, exported = HFCheckpointReader(tiny_hf_dir), HFCheckpointReader(out)
    assert sorted(exported.keys()) == sorted(original.keys())
    assert all(torch.equal(exported[n], original[n]) for n in original.keys())
    assert (out / "config.json").read_text() == (tiny_hf_dir / "config.json").read_text()
    assert not list(tmp_path.glob("*.tmp-*"))
