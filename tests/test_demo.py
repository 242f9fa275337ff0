"""`make demo` (gspo_mcore.run.demo): where it writes, and that it deletes nothing unless asked."""

import json
import subprocess
import sys

import pytest

from helpers import REPO, environment
from gspo_mcore.run.demo import CONFIG, DEFAULT_OUTPUT, check_run_dir, parse_args, train_command
from gspo_mcore.common.errors import InputError


def test_the_run_goes_under_the_output_dir_and_is_replaced_only_when_asked(tmp_path):
    assert parse_args([]).output_dir == DEFAULT_OUTPUT == REPO / "outputs" / "demo"
    cmd = train_command(tmp_path, overwrite=False)
    assert cmd[cmd.index("--config") + 1] == str(CONFIG) and cmd[cmd.index("--output-dir") + 1] == str(tmp_path / "tiny_cpu")
    assert f"model.hf_dir={tmp_path / 'toy' / 'model'}" in cmd and f"data.path={tmp_path / 'toy' / 'prompts.jsonl'}" in cmd
    assert "--overwrite" not in cmd and "--overwrite" in train_command(tmp_path, overwrite=True)


@pytest.mark.slow  # the demo in a subprocess
def test_a_second_demo_into_a_run_is_refused_before_anything_starts_with_the_demos_own_options(tmp_path):
    """It announced a server start, then refused with gspo-train's advice (--resume, --overwrite), which
    `make demo` does not take."""
    run = tmp_path / "out" / "tiny_cpu"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    (run / "notes.txt").write_text("mine")
    env = environment()
    proc = subprocess.run([sys.executable, "-m", "gspo_mcore.run.demo", "--output-dir", "out"], capture_output=True,
                          text=True, cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        f'error: {run}: holds a demo run already: make demo DEMO_ARGS=--overwrite replaces it, '
        'make demo DEMO_ARGS="--output-dir DIR" writes elsewhere']
    assert (run / "metrics.jsonl").read_text() == json.dumps({"step": 1}) + "\n" and (run / "notes.txt").is_file()
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "latest").write_text("step_000001")
    with pytest.raises(InputError, match="replaces it, make demo DEMO_ARGS=--resume continues it, make demo"):
        check_run_dir(run, overwrite=False)
    check_run_dir(run, overwrite=True)
    check_run_dir(run, overwrite=False, resume=True)
    with pytest.raises(InputError, match="no checkpoint to resume"):
        check_run_dir(tmp_path / "elsewhere", overwrite=False, resume=True)
    assert "--resume" in train_command(tmp_path, overwrite=False, resume=True)


def _row_of(line: str, printed) -> dict:
    """A metrics row with the figures a progress line shows (each figure's value read by its own format)."""
    import re

    head, body = line.split("] ", 1)
    row = {"step": int(head.split()[1].split("/")[0])}
    body = " " + body.rsplit(" | ETA", 1)[0]
    for metric in sorted(printed, key=lambda m: m.printed_if_nonzero):  # the line's order: those always shown first
        before, _, after = metric.printed.partition("{")
        spec, _, after = after.partition("}")
        share = spec.endswith("%")  # printed as a percentage: "truncated 98%"
        found = re.match(" " + re.escape(before) + r"(-?[0-9.]+(?:e[-+][0-9]+)?|-)" + ("%" if share else "")
                         + re.escape(after) + r"(?= |$)", body)
        if found:
            row[metric.name] = None if found.group(1) == "-" else float(found.group(1)) / (100 if share else 1)
            body = body[found.end():]
    for name, value in re.findall(r" \| (eval/\S+) ([0-9.]+)", body):
        row[name] = float(value)
    return row


def test_the_readmes_demo_output_is_what_the_demo_prints():
    """Each step line of the README's demo output is the progress line the code prints for its figures
    (names, order, formats), and the verdict lines are the demo's own format."""
    import io
    import re

    from gspo_mcore.metrics.report import PRINTED, Progress

    text = (REPO / "README.md").read_text()
    block = re.search(r"```\n(step .*?)```", text, re.S).group(1)
    steps = [line for line in block.splitlines() if line.startswith("step ")]
    assert len(steps) >= 2
    for line in steps:
        row = _row_of(line, PRINTED)
        total = int(line.split()[1].partition("/")[2])
        out = io.StringIO()
        Progress(total, row["step"] - 1, stream=out).update(row)
        assert out.getvalue().rsplit(" | ETA", 1)[0] == line.rsplit(" | ETA", 1)[0]
    from gspo_mcore.run.summary import lines

    verdict = [line for line in block.splitlines() if line.startswith(("mean reward:", "held-out "))]
    assert len(verdict) == 2
    first, last = (float(x) for x in re.findall(r"steps (0\.\d{3})", verdict[0]))
    before, after = (float(x) for x in re.findall(r" (0\.\d{3})", verdict[1]))
    assert lines({"window": 10, "reward_first": first, "reward_last": last, "reward_gain": last - first,
                  "held_out": {"eval/toy/mean@4": {"before": before, "after": after, "before_step": 0,
                                                   "after_step": 40}}}) == verdict  # the run's own format
