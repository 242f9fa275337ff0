"""Where a torch_dist checkpoint is (no Megatron needed): bad trackers are one-line errors."""

import pytest

from gspo_mcore.megatron.checkpointing import LATEST, TRACKER, checkpoint_dir
from gspo_mcore.common.errors import CheckpointError


def test_tracker_names_the_iteration_or_release(tmp_path):
    (tmp_path / TRACKER).write_text("release\n")
    assert checkpoint_dir(tmp_path) == tmp_path / "release"
    (tmp_path / TRACKER).write_text("12")
    assert checkpoint_dir(tmp_path) == tmp_path / "iter_0000012"


def test_a_runs_checkpoints_directory_is_a_save_root(tmp_path):
    """mcore-to-hf / verify take gspo-train's OUTPUT_DIR/checkpoints (or OUTPUT_DIR): `latest` names the step."""
    root = tmp_path / "run" / "checkpoints"
    for step in ("step_000020", "step_000040"):
        (root / step).mkdir(parents=True)
        (root / step / ".metadata").write_bytes(b"")
    (root / LATEST).write_text("step_000040")
    assert checkpoint_dir(root) == checkpoint_dir(tmp_path / "run") == root / "step_000040"
    (root / LATEST).write_text("step_000060")
    with pytest.raises(CheckpointError) as err:
        checkpoint_dir(root)
    assert str(err.value) == f"{root / LATEST}: names 'step_000060', which holds no checkpoint (.metadata)"


def test_tracker_with_garbage_is_named(tmp_path):
    (tmp_path / TRACKER).write_text("hi")
    with pytest.raises(CheckpointError) as err:
        checkpoint_dir(tmp_path)
    assert str(err.value) == f"{tmp_path / TRACKER}: expected an iteration number or 'release', found 'hi'"


def test_crafted_metadata_is_refused_not_run(tmp_path):
    """checkpoint_convert reads `.metadata` with an unpickler that admits only torch_dist
    metadata types: a pickle that would run a command is a one-line error, and runs nothing."""
    import json
    import pickle

    from checkpoint_convert.dcp_io import DCPReader

    class Exploit:
        def __reduce__(self):
            return (__import__("os").system, (f"touch {tmp_path / 'pwned'}",))

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Exploit()))
    (tmp_path / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    with pytest.raises(CheckpointError, match=r"not a Megatron-Core torch_dist checkpoint \(refusing (posix|os)\.system"):
        DCPReader(tmp_path)
    assert not (tmp_path / "pwned").exists()


@pytest.mark.slow  # the converter CLI in a subprocess
def test_real_metadata_still_loads(tmp_path):
    import torch
    from torch.distributed.checkpoint.metadata import Metadata

    from checkpoint_convert.dcp_io import load_metadata
    from gspo_mcore.megatron.qwen3_moe.tiny import make_tiny_checkpoint

    import subprocess
    import sys

    from helpers import REPO

    hf = make_tiny_checkpoint(tmp_path / "hf", seed=0, dtype=torch.bfloat16)
    subprocess.run([sys.executable, "-m", "checkpoint_convert", "hf-to-mcore", "--hf-dir", str(hf), "--output-dir",
                    str(tmp_path / "mc"), "--quiet"], check=True, cwd=REPO, capture_output=True)
    assert isinstance(load_metadata(tmp_path / "mc" / "release" / ".metadata"), Metadata)


WRITER_SAVE = """
import os, sys
import psutil, torch, torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from gspo_mcore.megatron import cpu_bridge
from gspo_mcore.megatron.checkpointing import keep_writer_results_in_process

if __name__ == "__main__":  # Megatron's own Manager is spawned: it imports this file again
    cpu_bridge.install()
    dist.init_process_group("gloo", init_method=f"file://{sys.argv[2]}/store", rank=0, world_size=1)
    if sys.argv[1] == "ours":
        keep_writer_results_in_process()  # what Checkpointer.save does first
    weight = torch.arange(6.0).reshape(2, 3)
    dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", weight)}, sys.argv[3])
    loaded = dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3))}, sys.argv[3])
    assert torch.equal(loaded["w"], weight)
    print(len(psutil.Process().children(recursive=True)), flush=True)
    dist.destroy_process_group()
"""


@pytest.mark.slow  # saves in a Python of its own (~6 s of CPU)
@pytest.mark.parametrize("how", ["ours"])  # "megatron": its Manager process stays (and dies of Ctrl-C)
def test_a_torch_dist_save_leaves_no_process_behind(tmp_path, how):
    """A save starts no process that outlives it: the writer's Manager, spawned by Megatron, re-imported the
    trainer (seconds), outlived a SIGKILLed trainer and, started during a Ctrl-C, died of it: an EOFError
    traceback instead of the save."""
    import subprocess
    import sys

    from helpers import REPO, environment

    script = tmp_path / "save.py"
    script.write_text(WRITER_SAVE)
    (tmp_path / "ckpt").mkdir()
    proc = subprocess.run([sys.executable, str(script), how, str(tmp_path), str(tmp_path / "ckpt")], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env=environment())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "0"


@pytest.mark.slow  # tests/workers/checkpoint_layout.py in a Python of its own (~8 s of CPU)
def test_checkpoints_of_the_layout_before_registered_parts_still_load(tiny_hf_dir, tmp_path):
    """A run's checkpoint as the Checkpointer wrote it before parts registered with it (with and
    without the lr schedule's state) loads into the registered parts: weights, RNG, schedule,
    step, rollout state; a new save writes the same files, keys and trainer_state.json."""
    from helpers import run_module

    proc = run_module(["tests/workers/checkpoint_layout.py", str(tiny_hf_dir), str(tmp_path / "out")])
    assert proc.stdout.strip().splitlines()[-1] == "ok"
