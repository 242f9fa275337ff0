"""Section 10: the rehearsed step measured. The rehearsal's step (gspo_mcore.rehearsal.phases: two
updates of one full microbatch and one of the longest sequence alone, one bucket of the weight
push, the sync check's forward) runs for real on this device at the check's shape (the 30B widths
at 2 layers, a 16k-token microbatch, GPU Adam) in a child, each phase's peak taken from the
allocator: torch.cuda.max_memory_allocated after reset_peak_memory_stats, less what was allocated
before the learner was built. Beside it, at the same time, `python -m gspo_mcore.rehearse` of the
same config on one device (a process of its own: on a CPU torch the fake devices load before
torch; on a CUDA build it runs on fake tensors beside the real device, gspo_mcore.rehearsal.device
.load), and the planner's figure per phase (gspo_mcore.rehearsal.cli.planner_phases). Each phase:
the three peaks, the ratios to the measured one and which of the two came nearer, so a first
device run says at once which to trust.

PASS when every phase's rehearsal is within REHEARSAL_TOLERANCE of the measured peak and met no
mismatch: what the rehearsal claims (issue #58); the planner's own tolerance is section 3's. On
CPU (the tiny shape) the run is measured by the rehearsal's count of real storages
(memory.RealCounting): the CPU path against the rehearsal's fake CUDA kernels, which agree to
~1% there (tests/test_gpu_check_parts.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

REHEARSAL_TOLERANCE = 0.10
EXTRA = ("optimizer.cpu_offload=false",)  # GPU Adam: the whole step's memory on the device
GB = 2**30


def section_10(check) -> dict:
    from gpucheck.shape import CONFIG, check_overrides

    shape = check.shape
    folder = check.work / "step_memory"
    folder.mkdir(parents=True, exist_ok=True)
    hf_json = folder / "config.json"  # the synthetic model's config.json, before any child writes its weights
    hf_json.write_text(json.dumps(shape.hf))
    hf_dir = check.work / f"synthetic_{shape.device}"
    command = [sys.executable, *(["-S"] if sys.flags.no_site else []), "-m", "gspo_mcore.rehearse",
               "--config", str(CONFIG), "--hf-config", str(hf_json), "--gpus-per-node", "1",
               *check_overrides(check.work, shape, hf_dir, "bfloat16", EXTRA)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "PYTHONWARNINGS": "ignore"}
    began = time.perf_counter()
    rehearsal = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                 start_new_session=True)  # beside the measured child: it needs the host only
    try:
        measured = check.child("gpucheck.step_memory:measured", extra=list(EXTRA))
    finally:
        rehearsed = rehearsal_result(rehearsal, check.child_timeout_s - (time.perf_counter() - began))
    return compare(measured, rehearsed)


def rehearsal_result(process: subprocess.Popen, timeout_s: float) -> dict:
    """The rehearse command's JSON line (its one role's), or {"error": ...} naming how it ended."""
    from gpucheck.children import kill_session

    try:
        out, err = process.communicate(timeout=max(timeout_s, 1.0))
    except subprocess.TimeoutExpired:
        kill_session(process)
        process.communicate()
        return {"error": f"the rehearsal ran past {timeout_s:.0f} s and was killed"}
    finally:
        kill_session(process)  # the parent interrupted
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if not lines:
        tail = [line for line in err.strip().splitlines() if line.strip()][-1:] or ["no output"]
        return {"error": f"the rehearsal exited with status {process.returncode}: {tail[0][-300:]}"}
    summary = json.loads(lines[-1])
    (role,) = summary["roles"].values()
    return {"phases": {name: p["peak_gb"] for name, p in role["phases"].items() if name != "host"},
            "by_kind_gb": {name: p["by_kind_gb"] for name, p in role["phases"].items() if name != "host"},
            "mismatches": role["mismatches"], "changes": summary["changes"]}


def compare(measured: dict, rehearsed: dict) -> dict:
    """Per phase the measured peak beside the rehearsal's and the planner's; the verdict."""
    figures = {"rehearsal_tolerance": REHEARSAL_TOLERANCE, **{k: v for k, v in measured.items()
                                                            if k not in ("phases", "planner", "pass")}}
    if "error" in rehearsed:
        figures["rehearsal_error"] = rehearsed["error"]
    figures["mismatches"] = rehearsed.get("mismatches", [])
    phases, within = {}, []
    for name, got in measured.get("phases", {}).items():
        row = {"measured_gb": got["peak_gb"], "measured_static_gb": got["static_gb"],
               "rehearsal_gb": rehearsed.get("phases", {}).get(name), "planner_gb": measured["planner"].get(name)}
        for source in ("rehearsal", "planner"):
            value = row[f"{source}_gb"]
            row[f"{source}_over_measured"] = value / row["measured_gb"] if value and row["measured_gb"] else None
        ratios = {s: abs(row[f"{s}_over_measured"] - 1) for s in ("rehearsal", "planner") if row[f"{s}_over_measured"]}
        row["nearer"] = min(ratios, key=ratios.get) if ratios else None
        if row["rehearsal_over_measured"] is not None:
            within.append(abs(row["rehearsal_over_measured"] - 1) <= REHEARSAL_TOLERANCE)
        phases[name] = row
    figures["phases"] = phases
    had_all = bool(phases) and "error" not in rehearsed and "error" not in measured and len(within) == len(phases)
    figures["rehearsal_within"] = all(within) if had_all else None
    figures["pass"] = had_all and not figures["mismatches"] and all(within)
    return figures


class Meter:
    """Each phase's peak on the learner's device, as `run_step`'s measure: the CUDA allocator's,
    or on CPU the rehearsal's count of real storages (the host allocator keeps no peak)."""

    def __init__(self, cuda: bool):
        import torch

        from gspo_mcore.rehearsal.memory import Counter, RealCounting

        self.cuda, self.torch = cuda, torch
        self.counter = None if cuda else Counter("cpu")
        self.counting = None if cuda else RealCounting(self.counter)
        self.phases: dict[str, dict] = {}
        self.baseline = torch.cuda.memory_allocated() if cuda else 0

    def __enter__(self):
        if self.counting is not None:
            self.counting.__enter__()
        return self

    def __exit__(self, *exc):
        if self.counting is not None:
            self.counting.__exit__(*exc)

    def allocated(self) -> int:
        if self.cuda:
            self.torch.cuda.synchronize()
            return self.torch.cuda.memory_allocated() - self.baseline
        self.counter.refresh()
        return self.counter.live_bytes()

    def phase(self, name: str, body) -> None:
        cuda = self.torch.cuda
        static = self.allocated()
        if self.cuda:
            cuda.reset_peak_memory_stats()
        else:
            self.counter.reset_peak()
        began = time.perf_counter()
        body()
        if self.cuda:
            cuda.synchronize()
            peak, reserved = cuda.max_memory_allocated() - self.baseline, cuda.max_memory_reserved()
        else:
            peak, reserved = self.counter.peak_bytes(), None
        row = {"peak_gb": peak / GB, "static_gb": static / GB, "seconds": round(time.perf_counter() - began, 3)}
        if reserved is not None:
            row["reserved_gb"] = reserved / GB
        if name not in self.phases or row["peak_gb"] >= self.phases[name]["peak_gb"]:
            self.phases[name] = row  # the largest of the phase's runs, as the rehearsal keeps it


def measured(check, extra=()) -> dict:
    """The child: a learner of the check's config (+ `extra`) running the rehearsal's step, each
    phase's peak; the planner's per phase for the same config on one device."""
    import torch

    from gpucheck.shape import check_config, make_inputs
    from gspo_mcore.megatron.learner import Learner
    from gspo_mcore.megatron.qwen3_moe.hf_config import parse_hf_config
    from gspo_mcore.planner.memory_model import check_layout
    from gspo_mcore.rehearsal.cli import planner_phases
    from gspo_mcore.rehearsal.phases import run_step

    shape, cuda = check.shape, check.device == "cuda"
    config = check_config(check.work, shape, make_inputs(check.work, shape), "bfloat16", extra)
    arch = parse_hf_config(shape.hf)
    if cuda:
        torch.cuda.init()
    planned = planner_phases(config, arch, check_layout(config, arch, 1, 1))
    with Meter(cuda) as meter:
        learner = Learner(config)
        run_step(learner, config, arch, 1, meter.phase)
    figures = {"overrides": list(extra), "layers": arch.num_layers, "tokens": shape.tokens,
               "phases": meter.phases, "planner": {name: kinds["total"] / GB for name, kinds in planned.items()
                                                    if name != "host"},
               "measured_by": "torch.cuda.max_memory_allocated" if cuda else "count of real storages (CPU)"}
    if cuda:
        figures["device"] = torch.cuda.get_device_name()
        figures["device_total_gb"] = torch.cuda.get_device_properties(0).total_memory / GB
    return figures
