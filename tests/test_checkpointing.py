"""Where a torch_dist checkpoint is (no Megatron needed): bad trackers are one-line errors."""

import pytest

from gspo_mcore.checkpointing import TRACKER, checkpoint_dir
from gspo_mcore.errors import CheckpointError


def test_tracker_names_the_iteration_or_release(tmp_path):
    (tmp_path / TRACKER).write_text("release\n")
    assert checkpoint_dir(tmp_path) == tmp_path / "release"
    (tmp_path / TRACKER).write_text("12")
    assert checkpoint_dir(tmp_path) == tmp_path / "iter_0000012"


def test_tracker_with_garbage_is_named(tmp_path):
    (tmp_path / TRACKER).write_text("hi")
    with pytest.raises(CheckpointError) as err:
        checkpoint_dir(tmp_path)
    assert str(err.value) == f"{tmp_path / TRACKER}: expected an iteration number or 'release', found 'hi'"
