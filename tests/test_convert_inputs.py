"""checkpoint_convert's input checks that run before anything is written (in-process: fast)."""

import json
import shutil
import subprocess
import sys

import pytest

from checkpoint_convert.convert import hf_to_mcore, mcore_to_hf, remove_stale_temporaries
from checkpoint_convert.verify import verify
from helpers import REPO, environment
from gspo_mcore.common.errors import CheckpointError, InputError


@pytest.fixture(scope="module")
def converted(tiny_hf_dir, tmp_path_factory):
    return hf_to_mcore(tiny_hf_dir, tmp_path_factory.mktemp("conv") / "mcore", quiet=True)


def test_output_that_is_holds_or_lies_inside_the_input_is_refused(tiny_hf_dir, tmp_path):
    """`--overwrite` with such an output used to delete the source checkpoint."""
    source = tmp_path / "x" / "model"
    shutil.copytree(tiny_hf_dir, source)
    before = sorted(p.name for p in source.iterdir())
    for out in (source, source / "mcore", tmp_path / "x"):
        with pytest.raises(InputError, match="is, contains or lies inside the input"):
            hf_to_mcore(source, out, overwrite=True, quiet=True)
    assert sorted(p.name for p in source.iterdir()) == before


def test_mcore_to_hf_refuses_its_inputs_as_output(converted, tiny_hf_dir, tmp_path):
    for out in (converted, converted / "hf", tiny_hf_dir):
        with pytest.raises(InputError, match="is, contains or lies inside the input"):
            mcore_to_hf(converted, tiny_hf_dir, out, overwrite=True, quiet=True)
    assert (converted / "latest_checkpointed_iteration.txt").is_file()


@pytest.mark.slow  # the converter CLI in a subprocess
def test_an_output_whose_parent_is_missing_is_one_line_exit_2_both_ways(converted, tiny_hf_dir, tmp_path):
    """It was a FileNotFoundError traceback from the disk-space check, exit 1."""
    out = tmp_path / "missing" / "out"
    for argv in (["hf-to-mcore", "--hf-dir", str(tiny_hf_dir)],
                 ["mcore-to-hf", "--mcore-dir", str(converted), "--hf-config-dir", str(tiny_hf_dir)]):
        proc = subprocess.run([sys.executable, "-m", "checkpoint_convert", *argv, "--output-dir", str(out), "--quiet"],
                              cwd=REPO, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert proc.stderr.strip().splitlines() == [
            f"error: {out.parent}: parent directory of the output does not exist (mkdir -p it first)"]
    assert not (tmp_path / "missing").exists()


def test_temporaries_of_killed_runs_are_removed(tiny_hf_dir, tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        out = tmp_path / "mcore"
        (tmp_path / f"mcore.tmp-{dead.pid}" / "release").mkdir(parents=True)
        (tmp_path / f"mcore.tmp-{alive.pid}").mkdir()
        (tmp_path / "other.tmp-1").mkdir()  # not ours
        hf_to_mcore(tiny_hf_dir, out, quiet=True)
        left = sorted(p.name for p in tmp_path.iterdir())
        assert left == sorted(["mcore", f"mcore.tmp-{alive.pid}", "other.tmp-1"]), left
        assert remove_stale_temporaries(out) == []
    finally:
        alive.kill()
        alive.wait()


@pytest.fixture
def fewer_layers(tiny_hf_dir, tmp_path):
    config_dir = tmp_path / "cfg"
    config_dir.mkdir()
    config = json.loads((tiny_hf_dir / "config.json").read_text())
    config["num_hidden_layers"] -= 1
    (config_dir / "config.json").write_text(json.dumps(config))
    return config_dir, config["num_hidden_layers"]


def test_a_config_with_fewer_layers_than_the_checkpoint_is_an_error(converted, fewer_layers, tmp_path):
    """It used to write a truncated model, and verify then said ok."""
    config_dir, layers = fewer_layers
    with pytest.raises(CheckpointError, match=rf"tensor 'decoder\.layers\.{layers}\..*' is not used by"):
        mcore_to_hf(converted, config_dir, tmp_path / "hf", quiet=True)
    assert not (tmp_path / "hf").exists()
    with pytest.raises(CheckpointError, match="is not used by"):
        verify(config_dir, converted)


@pytest.mark.slow  # the converter CLI in a subprocess
def test_verify_does_not_warn_of_torchs_sharded_tensor_deprecation(converted, tiny_hf_dir):
    proc = subprocess.run([sys.executable, "-m", "checkpoint_convert", "verify", "--hf-dir", str(tiny_hf_dir),
                           "--mcore-dir", str(converted)], capture_output=True, text=True, cwd=REPO, timeout=300,
                          env=environment(warnings=True))
    assert proc.returncode == 0 and json.loads(proc.stdout.strip().splitlines()[-1])["ok"], proc.stderr[-2000:]
    assert "ShardedTensor" not in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow  # the converter CLI in a subprocess
def test_verify_takes_quiet_and_exits_2_on_a_checkpoint_the_config_does_not_cover(converted, fewer_layers):
    env = environment(warnings=True)
    proc = subprocess.run([sys.executable, "-m", "checkpoint_convert", "verify", "--hf-dir", str(fewer_layers[0]),
                           "--mcore-dir", str(converted), "--quiet"], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().startswith("error: ") and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
