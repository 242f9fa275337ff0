"""`make demo` (gspo_mcore.demo): where it writes, and that it deletes nothing unless asked."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO
from gspo_mcore.demo import CONFIG, DEFAULT_OUTPUT, parse_args, train_command


def test_the_run_goes_under_the_output_dir_and_is_replaced_only_when_asked(tmp_path):
    assert parse_args([]).output_dir == DEFAULT_OUTPUT == REPO / "outputs" / "demo"
    cmd = train_command(tmp_path, overwrite=False)
    assert cmd[cmd.index("--config") + 1] == str(CONFIG) and cmd[cmd.index("--output-dir") + 1] == str(tmp_path / "tiny_cpu")
    assert f"model.hf_dir={tmp_path / 'toy' / 'model'}" in cmd and f"data.path={tmp_path / 'toy' / 'prompts.jsonl'}" in cmd
    assert "--overwrite" not in cmd and "--overwrite" in train_command(tmp_path, overwrite=True)


@pytest.mark.slow  # the demo's trainer in a subprocess
def test_a_second_demo_into_a_run_is_refused_and_deletes_nothing(tmp_path):
    run = tmp_path / "out" / "tiny_cpu"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    (run / "notes.txt").write_text("mine")
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "gspo_mcore.demo", "--output-dir", "out"], capture_output=True,
                          text=True, cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {run}: holds a run that saved no checkpoint") and "--overwrite" in last
    assert (run / "metrics.jsonl").read_text() == json.dumps({"step": 1}) + "\n" and (run / "notes.txt").is_file()
    assert (tmp_path / "out" / "toy" / "prompts.jsonl").is_file()  # the task, written where asked
