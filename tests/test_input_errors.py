"""Bad checkpoints and configs: one clear line naming the culprit, exit code 2."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import REPO

pytestmark = pytest.mark.slow  # runs the CLIs in subprocesses (and torchrun)


def run_parity(hf_dir, *overrides):
    return subprocess.run(
        [sys.executable, "-m", "gspo_mcore.megatron.parity", f"model.hf_dir={hf_dir}", *overrides],
        capture_output=True, text=True, cwd=REPO, timeout=300,
    )


def assert_one_line_error(proc, *fragments):
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for fragment in fragments:
        assert fragment in last, last


@pytest.fixture
def broken_copy(tiny_hf_dir, tmp_path):
    """A copy of the tiny checkpoint whose tensors the test can edit."""
    out = tmp_path / "hf"
    shutil.copytree(tiny_hf_dir, out)
    tensors = load_file(out / "model.safetensors")

    def edit(fn):
        fn(tensors)
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
        return out

    return edit


def test_missing_tensor_is_named(broken_copy):
    hf_dir = broken_copy(lambda t: t.pop("model.layers.2.self_attn.k_norm.weight"))
    assert_one_line_error(run_parity(hf_dir), "missing tensor 'model.layers.2.self_attn.k_norm.weight'")


def test_wrong_shape_is_named_with_expected_and_found(broken_copy):
    def shrink(t):
        t["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(64, 96)

    hf_dir = broken_copy(shrink)
    assert_one_line_error(
        run_parity(hf_dir), "model.layers.0.self_attn.o_proj.weight", "[64, 96]", "expected [64, 128]"
    )


def test_truncated_safetensors_is_named(tiny_hf_dir, tmp_path):
    out = tmp_path / "hf"
    shutil.copytree(tiny_hf_dir, out)
    data = (out / "model.safetensors").read_bytes()
    (out / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert_one_line_error(run_parity(out), "model.safetensors")


def test_unsupported_config_field_is_named(tiny_hf_dir, tmp_path):
    out = tmp_path / "hf"
    shutil.copytree(tiny_hf_dir, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["hidden_act"] = "gelu"
    (out / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(run_parity(out), "config.json", "hidden_act")


def test_bad_override_is_named(tiny_hf_dir):
    assert_one_line_error(run_parity(tiny_hf_dir, "distributed.tensor_paralel=2"), "tensor_paralel")


def test_layout_that_does_not_divide_is_named(tiny_hf_dir):
    # 4 layers cannot be split over 3 pipeline stages; checked before any process group work.
    assert_one_line_error(run_parity(tiny_hf_dir, "distributed.pipeline_parallel=3"), "num_hidden_layers 4", "pipeline_parallel")


@pytest.mark.parametrize("module", ["toy_task", "long_task", "agent_task"])
def test_a_task_writers_help_writes_nothing(module, tmp_path, monkeypatch, capsys):
    """`python -m gspo_mcore.tasks.agent --help` wrote a model into a directory named --help."""
    import importlib

    from gspo_mcore.tasks.toy import writer_cli

    monkeypatch.chdir(tmp_path)
    task = importlib.import_module(f"gspo_mcore.{module}")
    make = next(getattr(task, name) for name in dir(task) if name.startswith("make_") and name.endswith("_task"))
    with pytest.raises(SystemExit) as exit_:
        writer_cli(f"gspo_mcore.{module}", make, ["--help"])
    assert exit_.value.code == 0 and "OUT_DIR" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []
