"""atomic_output: the output appears whole when the block completes, and otherwise not at all."""

import os

import pytest

from gspo_mcore.common.files import atomic_output


def test_file_appears_only_when_complete(tmp_path):
    out = tmp_path / "data.jsonl"
    out.write_text("old\n")
    with atomic_output(out) as tmp:
        assert tmp == tmp_path / f"data.jsonl.tmp-{os.getpid()}" and not tmp.exists()
        tmp.write_text("new\n")
        assert out.read_text() == "old\n"  # readers still see the previous version
    assert out.read_text() == "new\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.jsonl"]


def test_failure_leaves_the_old_output_and_no_temporary(tmp_path):
    out = tmp_path / "data.jsonl"
    out.write_text("old\n")
    with pytest.raises(KeyError):
        with atomic_output(out) as tmp:
            tmp.write_text("half")
            raise KeyError("boom")
    assert out.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.jsonl"]


def test_directory_replaces_an_existing_one(tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "stale.bin").write_text("x")
    with atomic_output(out, directory=True) as tmp:
        assert tmp.is_dir() and not any(tmp.iterdir())
        (tmp / "config.json").write_text("{}")
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_directory_failure_removes_the_temporary(tmp_path):
    out = tmp_path / "model"
    with pytest.raises(RuntimeError):
        with atomic_output(out, directory=True) as tmp:
            (tmp / "part").write_text("x")
            raise RuntimeError
    assert not any(tmp_path.iterdir())


def test_a_stale_temporary_is_replaced(tmp_path):
    out = tmp_path / "model"
    stale = tmp_path / f"model.tmp-{os.getpid()}"
    stale.mkdir()
    (stale / "leftover").write_text("x")
    with atomic_output(out, directory=True) as tmp:
        assert tmp == stale and not any(tmp.iterdir())
        (tmp / "fresh").write_text("y")
    assert sorted(p.name for p in out.iterdir()) == ["fresh"]
