"""A section's heavy work in a process of its own: every learner arm, section 4's save and its
resume, the parity, the sync check, the host-Adam timing. The parent never builds a model, so what
one arm allocates (and whatever a dropped model keeps: issue #45's G4) never counts in another's
peak or takes room from it, and a child that dies (out of memory, a CUDA error, a signal) is one
FAIL line naming how it ended, not a dead check.

A child runs `function(check, **kwargs)` of `module:function` and writes its figures to a JSON file
the parent names (temporary name, then renamed); its stdout goes to stderr, so the check's stdout
holds JSON lines only. Two ways to start one (`--children`):
- "spawn" (the default on CUDA): a fresh interpreter running launch/gpu_check.py --child; nothing of
  the parent's state, its CUDA context included.
- "forkserver" (the default on CPU): forked from one server process that imported torch,
  megatron-core and the trainer once and ran nothing (multiprocessing's forkserver and its
  preload), so the ~10 s of imports are paid once, not per child. Not the CUDA default: a process
  forked after an import that initialised the CUDA driver (torch.cuda.is_available does) cannot
  use CUDA, and the preloaded imports are not known never to.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path


ENTRY = Path(__file__).resolve().parents[1] / "gpu_check.py"
MODES = ("spawn", "forkserver")
# What each child would otherwise import itself; the fork server imports them once (a missing one
# is skipped: multiprocessing.forkserver.main ignores an ImportError).
PRELOAD = ["torch", "transformers", "megatron.core", "gspo_mcore.megatron.learner", "gspo_mcore.megatron.parity",
           "gspo_mcore.megatron.checkpointing", "gspo_mcore.weight_sync.check", "gspo_mcore.engines.vllm.engine",
           "gspo_mcore.planner.memory_model", "gspo_mcore.planner.costs", "checkpoint_convert.synthetic",
           "gpucheck.shape", "gpucheck.updates"]


def run_child(check, target: str, kwargs: dict, body) -> dict:
    """`target`'s figures from a child process started as `check.children` says; a child that
    ended without figures (killed, crashed, timed out) is a FAIL naming how it ended. `body`:
    what a forked child runs (gpucheck.context.run_in_child, handed in: this module imports no
    other of the check's)."""
    with tempfile.TemporaryDirectory(prefix="child_", dir=check.work) as tmp:
        result = Path(tmp) / "result.json"
        if check.children == "spawn":
            exit_code = spawn(target, kwargs, check.common(), result, check.child_timeout_s)
        else:
            exit_code = fork(target, kwargs, check.common(), result, check.child_timeout_s, body)
        if not result.exists():
            return {"pass": False, "error": f"{target}: the child process {ended(exit_code, check.child_timeout_s)} "
                                            "without a result (its stderr is above)"}
        figures = json.loads(result.read_text())
    if exit_code != 0:  # figures written, then a crash or a hang on the way out: worth seeing
        figures["child_exit"] = ended(exit_code, check.child_timeout_s)
    return figures


def ended(exit_code: int | None, timeout_s: float) -> str:
    """How a child process ended, in words."""
    if exit_code is None:
        return f"ran past {timeout_s:g} s and was killed"
    if exit_code < 0:
        name = signal.Signals(-exit_code).name
        return f"was killed by {name}" + (" (the kernel's OOM killer?)" if name == "SIGKILL" else "")
    return f"exited with status {exit_code}"


def spawn(target: str, kwargs: dict, common: dict, result: Path, timeout_s: float) -> int | None:
    """A fresh interpreter on launch/gpu_check.py --child; its exit status (None: timed out). The
    parent's sys.path goes with it (the wheel folder, the repository, a test's stand-in module);
    its own session, so a timeout kills what it started too (section 7's stand-in server)."""
    command = [sys.executable, *(["-S"] if sys.flags.no_site else []), str(ENTRY), "--child", target,
               "--child-args", json.dumps(kwargs), "--result", str(result), "--device", common["device"],
               "--work", common["work"], "--wheels", common["wheels"], "--children", common["children"]]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    process = subprocess.Popen(command, stdout=2, env=env, start_new_session=True)
    try:
        return process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        return None
    finally:
        kill_session(process)  # timed out, or the parent was interrupted
        process.wait()


def kill_session(process: subprocess.Popen) -> None:
    """SIGKILL to the session of `process` (started with start_new_session) and all it started, if
    it still runs."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
            os.killpg(process.pid, signal.SIGKILL)


def fork(target: str, kwargs: dict, common: dict, result: Path, timeout_s: float, body) -> int | None:
    """A child forked from multiprocessing's fork server (started at the first call, PRELOAD
    imported there); its exit status (None: timed out)."""
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    start_fork_server(context)
    process = context.Process(target=forked, args=(body, target, kwargs, common, str(result)), name=target)
    process.start()
    try:
        process.join(timeout_s)
    except BaseException:  # the parent interrupted: the child goes too
        process.kill()
        raise
    if process.is_alive():
        process.kill()
        process.join()
        return None
    return process.exitcode


def start_fork_server(context) -> None:
    """The fork server, with PRELOAD imported from this process's sys.path (the wheel folder, the
    repository): Python 3.11's forkserver.main takes the path but never sets it, so it goes as
    PYTHONPATH in the server's environment."""
    from multiprocessing import forkserver

    context.set_forkserver_preload(PRELOAD)
    kept = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    try:
        forkserver.ensure_running()  # a no-op once it runs
    finally:
        if kept is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = kept


def forked(body, target: str, kwargs: dict, common: dict, result: str) -> None:
    os.dup2(2, 1)  # the check's stdout holds its JSON lines only
    body(target, kwargs, common, Path(result))
