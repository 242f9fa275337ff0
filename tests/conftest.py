import json
import os
from pathlib import Path

import pytest

# Before any test module imports megatron.core: gspo_mcore.megatron installs the finder that keeps
# megatron's import from compiling its fused functions at decoration (TorchDynamo and Inductor
# imported, ~2 s of CPU in each worker's collection otherwise). The package itself imports nothing.
import gspo_mcore.megatron  # noqa: F401

# Re-exported for the modules that still import them from here; new code imports tests/helpers.py.
from helpers import REPO, last_json_line, run_module  # noqa: F401

# One OpenMP thread per process (the servers the tests start, the ranks, torch in the workers)
# unless the caller chose: `make test` runs three workers on two cores, where a second thread
# spinning at a barrier while another process holds its core burns that core (measured: the
# agent task's warm start took 287 s under the suite with two threads, ~25 s alone).
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Parallel layouts the model must be exact under: name -> (processes, config overrides).
LAYOUTS = {
    "single": (1, []),
    "EP2": (2, ["distributed.expert_parallel=2"]),
    "PP2": (2, ["distributed.pipeline_parallel=2"]),
    # ETP=1: experts unsplit and replicated over the TP ranks, each running its own tokens.
    "TP2-SP": (2, ["distributed.tensor_parallel=2"]),
    "TP2-SP-ETP2": (2, ["distributed.tensor_parallel=2", "distributed.expert_tensor_parallel=2"]),
    "DP2": (2, []),
}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """Tests that need a parallel layout's torchrun launch are slow (`pytest -m "not slow"`
    skips them) and share one xdist group, so each layout launches once under `make test`'s
    workers; modules that start torchrun or SGLang otherwise mark themselves. First of the hooks:
    xdist's worker names an item's group (its node id's `@group`) in its own hook, which ran before
    this one, so the layout tests had no group and each worker launched every layout it met again,
    with all of that layout's planned jobs."""
    for item in items:
        if "layout_output" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
            item.add_marker(pytest.mark.xdist_group("layouts"))


@pytest.hookimpl(tryfirst=True)  # before xdist's own (the hook takes the first result)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup`: the heaviest group first (tests/xdist_order.py)."""
    if config.getvalue("dist") == "loadgroup":
        from xdist_order import scheduler

        return scheduler(config, log)
    return None


# Time per xdist group (setup + call + teardown of its tests), printed at the end: a group runs on
# one worker, so the longest one bounds the tier's wall time whatever the others do.
_GROUP_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    group = report.nodeid.rpartition("@")[2] if "@" in report.nodeid else "(none)"
    _GROUP_SECONDS[group] = _GROUP_SECONDS.get(group, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if _GROUP_SECONDS:
        ranked = sorted(_GROUP_SECONDS.items(), key=lambda kv: -kv[1])
        terminalreporter.write_line("time per xdist group: " + ", ".join(f"{g} {s:.0f} s" for g, s in ranked))


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory) -> Path:
    """A random tiny Qwen3-MoE (float32) in Hugging Face format."""
    from gspo_mcore.megatron.qwen3_moe.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_hf"), seed=0)


# The toy task (gspo_mcore.tasks.toy) and one float32 engine serving it, shared by the modules of
# a worker (here, not in a module that others import from: pytest would make one per module).
@pytest.fixture(scope="session")
def toy(tmp_path_factory):
    from gspo_mcore.tasks.toy import make_toy_task

    return make_toy_task(tmp_path_factory.mktemp("toy") / "task", seed=0)


@pytest.fixture(scope="session")
def server(toy, tmp_path_factory):
    """A float32 engine of the toy model for runs that do not start their own: each run pushes its
    initial weights first, so a previous run's weights do not leak in."""
    from gspo_mcore.common.processes import ManagedServer
    from gspo_mcore.engines.sglang.server import sglang_command
    from gspo_mcore.engines.sglang.sglang_cpu import server_env

    def command(port):
        return sglang_command(str(toy / "model"), port, dtype="float32", max_running_requests=128,
                              extra_args=("--disable-radix-cache",))

    log = tmp_path_factory.mktemp("logs") / "sglang.log"
    with ManagedServer.on_free_port(command, log, env=server_env()) as managed:
        yield managed.url

@pytest.fixture(scope="session")
def vllm_toy(tmp_path_factory):
    """The toy task with attention heads of 64 (vLLM's CPU attention needs them), as
    configs/tiny_cpu_vllm.yaml's writer command makes it."""
    from gspo_mcore.tasks.toy import make_toy_task

    return make_toy_task(tmp_path_factory.mktemp("vllm_toy") / "task", seed=0, head_dim=64)


def vllm_server(model_dir, log, env: dict | None = None, **options):
    """A float32 vLLM server (.venv-vllm) of `model_dir`, as a run would start it; `env`: variables
    added to its environment."""
    from gspo_mcore.common.processes import ManagedServer
    from gspo_mcore.engines.vllm.server import server_env, vllm_command

    def command(port):
        return vllm_command(str(model_dir), port, python=str(REPO / ".venv-vllm" / "bin" / "python"), dtype="float32",
                            **options)

    return ManagedServer.on_free_port(command, log, env={**server_env(device="cpu"), **(env or {})})


# ------------------------------------------------------------ one torchrun launch per layout
# A launch costs ~9 s of imports here. Test modules plan their multi-rank jobs at import
# (collection) with plan_layout_job; the first test that asks layout_output for a layout runs
# every job planned for it in one launch (tests/workers/jobs.py) and the rest read the results.
_PLANNED: dict[str, dict[str, dict]] = {}  # layout -> job name -> job


def plan_layout_job(name: str, kind: str, layouts, options=(), batch=None) -> None:
    """kind: a job of tests/workers/jobs.py; options: config overrides besides the layout's;
    batch: hf_dir -> dict of tensors, train_step's global batch."""
    for layout in layouts:
        assert layout in LAYOUTS and name not in _PLANNED.get(layout, {}), (name, layout)
        _PLANNED.setdefault(layout, {})[name] = {"kind": kind, "options": list(options), "batch": batch}


def run_jobs(jobs: list[dict], nproc: int, spec_dir: Path, timeout: int = 600) -> None:
    spec = spec_dir / "jobs.json"
    spec.write_text(json.dumps(jobs))
    run_module(["tests/workers/jobs.py", str(spec)], nproc=nproc, timeout=timeout)


@pytest.fixture(scope="session")
def layout_output(tiny_hf_dir, tmp_path_factory):
    """layout_output(layout, job name) -> that job's output directory."""
    import torch

    runs: dict[str, Path | str] = {}  # layout -> its output root, or why its launch failed

    def get(layout: str, name: str) -> Path:
        if layout not in runs:
            root = tmp_path_factory.mktemp(f"layout-{layout}")
            nproc, overrides = LAYOUTS[layout]
            jobs = []
            for job_name, job in _PLANNED[layout].items():
                spec = {"kind": job["kind"], "hf_dir": str(tiny_hf_dir), "out_dir": str(root / job_name),
                        "overrides": [*job["options"], *overrides]}
                if job["batch"] is not None:
                    spec["batch_file"] = str(root / f"{job_name}.batch.pt")
                    torch.save(job["batch"](tiny_hf_dir), spec["batch_file"])
                jobs.append(spec)
            try:
                run_jobs(jobs, nproc, root)
                runs[layout] = root
            except pytest.fail.Exception as failure:
                runs[layout] = str(failure)
        if isinstance(runs[layout], str):
            pytest.fail(runs[layout], pytrace=False)
        return runs[layout] / name

    return get
