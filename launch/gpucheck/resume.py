"""Section 4: a torch_dist save (gspo_mcore.megatron.checkpointing.Checkpointer) of a learner that
took one update, in a child; then, after that child exited, a second child resumes it: every
parameter and optimizer state equal (hashes), and one more update runs. Each in a process of its
own, so the resume has the whole GPU (on the first H100 run it OOMed beside its parent)."""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path


def section_4(check) -> dict:
    out = check.work / f"resume_{check.device}"
    saved = check.child("gpucheck.resume:save", out=str(out))
    if saved.get("pass") is not True:
        return {**saved, "pass": False, "stage": "save"}
    resumed = check.child("gpucheck.resume:resume", out=str(out))
    figures = {**{k: v for k, v in saved.items() if k != "pass"}, **resumed}
    figures["save_child_s"], figures["resume_child_s"] = saved.get("child_s"), resumed.get("child_s")
    figures.pop("child_s", None)
    if resumed.get("error"):
        figures["stage"] = "resume"
    return figures


def _learner_and_checkpointer(check, out: Path):
    from gpucheck.shape import check_config, make_inputs
    from gspo_mcore.megatron.checkpointing import Checkpointer, MegatronState
    from gspo_mcore.megatron.learner import Learner

    config = check_config(check.work, check.shape, make_inputs(check.work, check.shape), "bfloat16")
    learner = Learner(config)
    checkpointer = Checkpointer(out, learner.model)
    checkpointer.register("megatron", MegatronState(learner.ddp, learner.optimizer))
    return learner, checkpointer


def save(check, out: str) -> dict:
    """The saving child: the check's learner (the config's optimizer), one update, a save at step
    1, and the hashes the resume must find (digest.json)."""
    from gpucheck.shape import optimizer_digest, param_digest, update_once

    out = Path(out)
    shutil.rmtree(out, ignore_errors=True)  # an earlier run's save: step 1 again
    learner, checkpointer = _learner_and_checkpointer(check, out)
    report, _ = update_once(learner, check.shape, step=1)
    began = time.perf_counter()
    checkpointer.save(1)
    saved_s = time.perf_counter() - began
    expected = {"params": param_digest(learner.model), "optimizer": optimizer_digest(learner.optimizer)}
    (out / "digest.json").write_text(json.dumps(expected))
    return {"save_s": saved_s, "pass": math.isfinite(report.get("loss", float("nan")))}


def resume(check, out: str) -> dict:
    """The resuming child: the same learner loaded from the save; every hash compared; one more
    update."""
    from gpucheck.shape import optimizer_digest, param_digest, update_once

    out = Path(out)
    learner, checkpointer = _learner_and_checkpointer(check, out)
    began = time.perf_counter()
    step = checkpointer.load()
    loaded_s = time.perf_counter() - began
    expected = json.loads((out / "digest.json").read_text())
    params, states = param_digest(learner.model), optimizer_digest(learner.optimizer)
    report, _ = update_once(learner, check.shape, step=step + 1)
    figures = {"resumed_step": step, "load_s": loaded_s, "params_equal": params == expected["params"],
               "optimizer_states": sorted(states), "optimizer_equal": states == expected["optimizer"],
               "stepped_again": math.isfinite(report.get("loss", float("nan")))}
    figures["pass"] = figures["params_equal"] and figures["optimizer_equal"] and figures["stepped_again"]
    return figures
