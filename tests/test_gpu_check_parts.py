"""The one-GPU check's pieces, each a function run here on CPU (launch/gpucheck/): its JSON lines
and --out file, its child processes (a child that dies is a FAIL line and the check goes on),
section 3's arms, section 8's figures for the planner, section 9's layer count, phases and line,
and the registry's time budget. The whole
check on a bare machine is test_gpu_check.py's."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from helpers import REPO

sys.path.insert(0, str(REPO / "launch"))
from gpucheck import children, host_adam, lines, main, registry, step_memory, throughput, updates  # noqa: E402
from gpucheck.context import Check  # noqa: E402

sys.path.remove(str(REPO / "launch"))

STAND_IN = '''
import os, signal, time

def fine(check, value):
    return {"value": value, "device": check.device, "pass": True}

def raises(check):
    raise RuntimeError("CUDA error: an illegal memory access")

def exits(check):
    os._exit(3)

def killed(check):
    os.kill(os.getpid(), signal.SIGKILL)

def hangs(check):
    time.sleep(60)
'''


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """A module of child functions a child process can import (the parent's sys.path goes with it)."""
    folder = tmp_path / "mods"
    folder.mkdir()
    (folder / "standin_children.py").write_text(textwrap.dedent(STAND_IN))
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.syspath_prepend(str(REPO / "launch"))  # as for launch/gpu_check.py: a forked child imports gpucheck
    return "standin_children"


def a_check(tmp_path, **options) -> Check:
    return Check(device="cpu", work=tmp_path, wheels=tmp_path / "no-wheels", **options)


# ------------------------------------------------------------------ lines and --out

def test_a_line_says_pass_fail_or_skip_from_its_figures():
    assert lines.verdict({"pass": True, "x": 1}) == ("PASS", {"x": 1})
    assert lines.verdict({"skip": "needs a GPU", "pass": True}) == ("SKIP", {"skip": "needs a GPU"})
    assert lines.verdict({"x": 1})[0] == "FAIL"  # no verdict is not a pass
    assert lines.verdict({"pass": 1})[0] == "FAIL"  # a verdict is a bool
    line = lines.section_line(4, "save", "cpu", 1.234, {"pass": False, "error": "E: x"})
    assert line == {"section": 4, "name": "save", "result": "FAIL", "device": "cpu", "seconds": 1.23, "error": "E: x"}
    assert lines.part_line(3, "offload", {"skip": "CUDA only"}) == {"section": 3, "part": "offload", "result": "SKIP",
                                                                     "skip": "CUDA only"}
    assert lines.error_figures(ValueError("x" * 400)) == {"pass": False, "error": "ValueError: " + "x" * 300}


def test_out_appends_each_line_as_it_is_made_and_stdout_prints_it(tmp_path, capsys):
    out = tmp_path / "out"
    first = lines.Lines("run-1", out)
    first.emit({"section": 1, "result": "PASS"})
    # on disk at once, before anything else happens
    assert [json.loads(line) for line in (out / "gpu_check.jsonl").read_text().splitlines()] == [
        {"section": 1, "result": "PASS", "run": "run-1"}]
    lines.Lines("run-2", out).emit({"section": 2, "result": "FAIL", "nan": float("nan")})
    on_disk = (out / "gpu_check.jsonl").read_text().splitlines()
    assert [json.loads(line)["run"] for line in on_disk] == ["run-1", "run-2"]  # appended, runs told apart
    assert capsys.readouterr().out.splitlines() == on_disk


def test_a_killed_run_keeps_the_lines_it_made(tmp_path):
    """The check dies in section 2 (SIGKILL, as the OOM killer does): section 1's line is on disk."""
    driver = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(REPO / "launch")!r})
        from gpucheck import main, registry
        registry.BY_NUMBER[1] = registry.Section(1, "fine", lambda check: {{"pass": True, "figure": 7}}, 1)
        registry.BY_NUMBER[2] = registry.Section(2, "dies", lambda check: os.kill(os.getpid(), signal.SIGKILL), 1)
        main.main(["--device", "cpu", "--work", sys.argv[1], "--out", sys.argv[2], "--only", "1", "--only", "2"])
    """)
    proc = subprocess.run([sys.executable, "-c", driver, str(tmp_path / "work"), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    kept = [json.loads(line) for line in (tmp_path / "out/gpu_check.jsonl").read_text().splitlines()]
    assert [(line["section"], line["result"], line["figure"]) for line in kept] == [(1, "PASS", 7)]


# ------------------------------------------------------------------ child processes

@pytest.mark.parametrize("mode", children.MODES)
def test_a_child_returns_its_figures_and_a_child_that_raises_is_a_fail(tmp_path, stand_in, mode, monkeypatch):
    monkeypatch.setattr(children, "PRELOAD", [])  # the stand-ins import nothing heavy
    check = a_check(tmp_path, children=mode)
    figures = check.child(f"{stand_in}:fine", value=[1, 2])
    assert figures["value"] == [1, 2] and figures["device"] == "cpu" and figures["pass"] is True
    assert check.child(f"{stand_in}:raises")["error"] == "RuntimeError: CUDA error: an illegal memory access"
    assert list(tmp_path.iterdir()) == [tmp_path / "mods"]  # the result files went with their folders


@pytest.mark.parametrize("mode", children.MODES)
@pytest.mark.parametrize("how, said", [("exits", "exited with status 3"),
                                       ("killed", "was killed by SIGKILL (the kernel's OOM killer?)"),
                                       ("hangs", "ran past 2 s and was killed")])
def test_a_child_that_dies_is_one_line_naming_how(tmp_path, stand_in, mode, how, said, monkeypatch):
    monkeypatch.setattr(children, "PRELOAD", [])
    timeout_s = 2 if how == "hangs" else 120  # a loaded machine may take seconds to start a child
    figures = a_check(tmp_path, children=mode, child_timeout_s=timeout_s).child(f"{stand_in}:{how}")
    assert figures == {"pass": False, "error": f"{stand_in}:{how}: the child process {said} without a result "
                                               "(its stderr is above)"}


def test_a_section_whose_child_crashes_is_a_fail_line_and_the_next_section_runs(tmp_path, stand_in, monkeypatch,
                                                                                 capsys):
    """The check survives a section's child dying (section 6 here), and section 5 still prints."""
    monkeypatch.setitem(registry.BY_NUMBER, 6, registry.Section(6, "crashes", lambda c: c.child(f"{stand_in}:killed"),
                                                                 1))
    code = main.main(["--device", "cpu", "--wheels", str(tmp_path / "none"), "--work", str(tmp_path / "work"),
                      "--only", "6", "--only", "5", "--children", "spawn"])
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert code == 1 and [(line["section"], line["result"]) for line in printed] == [(6, "FAIL"), (5, "SKIP")]
    assert "was killed by SIGKILL" in printed[0]["error"]


def test_a_section_that_raises_in_the_parent_is_a_fail_line(tmp_path, monkeypatch, capsys):
    def broken(check):
        raise RuntimeError("CUDA error: an illegal memory access")

    monkeypatch.setitem(registry.BY_NUMBER, 6, registry.Section(6, "broken", broken, 1))
    code = main.main(["--device", "cpu", "--wheels", str(tmp_path / "none"), "--work", str(tmp_path), "--only", "6"])
    line = json.loads(capsys.readouterr().out)
    assert code == 1 and line["result"] == "FAIL"
    assert line["error"] == "RuntimeError: CUDA error: an illegal memory access"


# ------------------------------------------------------------------ section 3's arms

def test_section_3_runs_each_arm_in_a_child_and_prints_it_as_measured(tmp_path, monkeypatch):
    """An arm that cannot run is skipped before any child; each arm that runs is a child of its
    own with its overrides; its line is out before the next arm starts; one failing arm fails the section."""
    started, out = [], tmp_path / "out"
    figures = {("optimizer.cpu_offload=false",): {"update_s": 1.0, "peak_minus_baseline_gb": 30.0, "pass": True},
               (): {"update_s": 3.0, "peak_minus_baseline_gb": 20.0, "pass": True}}

    def child(self, target, **kwargs):
        assert target == "gpucheck.updates:arm"
        on_disk = (out / "gpu_check.jsonl").read_text().splitlines() if (out / "gpu_check.jsonl").exists() else []
        started.append((tuple(kwargs["extra"]), len(on_disk)))
        return dict(figures[tuple(kwargs["extra"])])

    monkeypatch.setattr(Check, "child", child)
    monkeypatch.setattr(updates, "transformer_engine_importable", lambda: False)
    check = Check(device="cuda", work=tmp_path, wheels=tmp_path, lines=lines.Lines("r", out))
    section = updates.section_3(check)
    assert started == [((), 0), (("optimizer.cpu_offload=false",), 1)]  # each after the previous arm's line
    assert section["arms"] == {"offload": "PASS", "device_adam": "PASS", "precision_aware": "SKIP"}
    assert section["offload_update_s_over_device_adam"] == 3.0 and section["pass"] is True
    assert section["peak_minus_baseline_gb_by_arm"] == {"offload": 20.0, "device_adam": 30.0}
    parts = [json.loads(line) for line in (out / "gpu_check.jsonl").read_text().splitlines()]
    assert [(p["part"], p["result"]) for p in parts] == [("offload", "PASS"), ("device_adam", "PASS"),
                                                         ("precision_aware", "SKIP")]
    assert parts[2]["skip"].startswith("optimizer.precision_aware: Transformer Engine is not importable")
    figures[()]["pass"] = False
    assert updates.section_3(check)["pass"] is False


def test_an_arm_is_skipped_up_front_where_it_cannot_run(monkeypatch):
    assert updates.arm_skip("offload", "cpu").startswith("optimizer.cpu_offload: Megatron's HybridDeviceOptimizer")
    assert updates.arm_skip("device_adam", "cpu") is None and updates.arm_skip("offload", "cuda") is None
    assert updates.arm_skip("precision_aware", "cpu").startswith("optimizer.precision_aware: needs CUDA")
    monkeypatch.setattr(updates, "transformer_engine_importable", lambda: True)
    assert updates.arm_skip("precision_aware", "cuda") is None


def test_an_arm_reports_what_it_took_against_the_planner():
    """Peak minus the baseline allocated before the learner, over the planner's estimate."""
    gib = 2**30
    figures = updates.memory_figures({"trainer_total_gb": 20.0, "trainer_optimizer_gb": 0.0}, 1.5, 2 * gib, 34 * gib)
    assert figures == {"planned_gb": 20.0, "planned_optimizer_gb": 0.0, "tolerance": 1.5, "baseline_gb": 2.0,
                       "peak_gb": 34.0, "peak_minus_baseline_gb": 32.0, "peak_over_planned": 1.6, "within": False}
    assert updates.memory_figures({"trainer_total_gb": 20.0}, 1.5, None, None) == {
        "planned_gb": 20.0, "planned_optimizer_gb": None, "tolerance": 1.5}  # CPU: no allocator figures


# ------------------------------------------------------------------ section 8: host Adam

def test_host_adam_measures_megatrons_host_step_at_each_thread_count(tmp_path):
    figures = host_adam.measure(a_check(tmp_path), threads=(1, 2))
    assert figures["pass"] and figures["moved"] and figures["params"] == 4 * 16384
    assert set(figures["cpu_step_ns_per_param"]) == {"1", "2"}
    assert all(ns > 0 for ns in figures["cpu_step_ns_per_param"].values())
    assert figures["copy_to_host_ns_per_param"] is None and figures["copy_back_ns_per_param"] is None  # no GPU
    assert figures["source"].startswith("launch/gpu_check.py section 8") and "no GPU" in figures["source"]


def test_host_adam_writes_what_the_planner_reads_and_its_30b_figure(tmp_path):
    """The line's four fields, alone in host_adam.json, load as the planner's HostAdamFigures, and
    the check prints the seconds they make of the 30B config's step on 8 GPUs."""
    from gspo_mcore.planner.host_adam import load_figures

    measured = {"copy_to_host_ns_per_param": 0.2, "copy_back_ns_per_param": 0.25,
                "cpu_step_ns_per_param": {"2": 1.5, "16": 0.3}, "source": "a test", "params": 100, "pass": True}
    path = host_adam.write_figures(tmp_path / "host_adam.json", measured)
    assert set(json.loads(path.read_text())) == set(host_adam.FIELDS)
    loaded = load_figures(path)
    assert loaded.cpu_step_ns_per_param == {2: 1.5, 16: 0.3} and loaded.source == "a test"
    at_30b = host_adam.at_30b_ep8(measured)
    params = at_30b["params_per_gpu_b"] * 1e9
    assert 3.7 < at_30b["params_per_gpu_b"] < 3.9  # the experts' eighth and a dense shard
    assert at_30b["optimizer_step_s_at_2_threads"] == pytest.approx(params * (0.2 + 1.5 + 0.25) / 1e9)
    assert at_30b["training_step_s_at_16_threads"] == pytest.approx(
        at_30b["optimizer_step_s_at_16_threads"] * at_30b["optimizer_steps_per_training_step"])


def test_section_8_writes_host_adam_json_only_from_measured_copies(tmp_path, monkeypatch):
    """On CPU the copies are null (the planner would refuse them): no file."""
    out = tmp_path / "out"
    check = Check(device="cpu", work=tmp_path, wheels=tmp_path, lines=lines.Lines("r", out))
    cpu_line = {"copy_to_host_ns_per_param": None, "copy_back_ns_per_param": None,
                "cpu_step_ns_per_param": {"2": 1.0}, "source": "s", "pass": True}
    monkeypatch.setattr(Check, "child", lambda self, target: dict(cpu_line))
    assert "written" not in host_adam.section_8(check) and not (out / "host_adam.json").exists()
    monkeypatch.setattr(Check, "child", lambda self, target: {**cpu_line, "copy_to_host_ns_per_param": 0.1,
                                                              "copy_back_ns_per_param": 0.1})
    assert host_adam.section_8(check)["written"] == str(out / "host_adam.json")


# ------------------------------------------------------------------ section 9: throughput

def test_section_9_takes_the_most_layers_whose_planner_estimate_fits_the_device(tmp_path):
    """At the 30B widths beside GPU Adam (~10.5 GiB a layer at EP 1) an H100 holds a few layers:
    the count is the planner's largest under the device less the CUDA context and the margin."""
    from gpucheck.shape import Shape, check_config
    from gspo_mcore.planner.memory_model import H100_GB, TRAINER_CONTEXT_GB

    shape = Shape("cuda")
    config = check_config(tmp_path, shape, tmp_path / "hf", "bfloat16", throughput.fast_path_overrides()[0])
    assert config.optimizer.cpu_offload is False and config.train.max_tokens_per_microbatch == 16384

    def estimate(layers):
        return throughput.planned(config, shape.hf, layers, shape.prompt)["trainer_total_gb"]

    layers = throughput.layers_that_fit(config, shape.hf, shape.prompt, H100_GB, 48)
    room = H100_GB - TRAINER_CONTEXT_GB - throughput.MARGIN_GB
    assert estimate(layers) <= room < estimate(layers + 1)
    assert 3 <= layers <= 6 and 9 < estimate(layers + 1) - estimate(layers) < 12
    assert throughput.layers_that_fit(config, shape.hf, shape.prompt, 4000.0, 48) == 48  # the model's own count
    with pytest.raises(RuntimeError, match="not one layer fits: the planner's estimate at 1 layer is over the "
                                           "device's 20.0 GiB"):
        throughput.layers_that_fit(config, shape.hf, shape.prompt, 20.0, 48)


def test_section_9_asks_for_what_the_schema_has():
    assert throughput.schema_has("model.spec", "local") and throughput.schema_has("optimizer.cpu_offload")
    assert not throughput.schema_has("model.spec", "fast") and not throughput.schema_has("model.nope")
    assert not throughput.schema_has("nope.spec")
    overrides, notes = throughput.fast_path_overrides()
    assert overrides[0] == "optimizer.cpu_offload=false"
    assert (f"model.spec={throughput.FAST_SPEC}" in overrides) != ("spec_note" in notes)  # one or the other
    assert (f"{throughput.FUSED_LOGPROBS}=true" in overrides) != ("fused_logprobs_note" in notes)


class RecordingClock(throughput.PhaseClock):
    def __init__(self):
        super().__init__(cuda=False)
        self.order = []

    def mark(self, name):
        super().mark(name)
        self.order.append(name)


@pytest.mark.parametrize("output_layer", [True, False])
def test_section_9_times_each_phase_from_hooks_and_leaves_nothing_behind(output_layer):
    """A forward, its loss, backward and the step as Megatron's schedule runs them: the marks
    come in that order and make each phase; after the block no hook or wrapper stays. Without an
    output-layer call (the fused log-probs take the hidden states), the logits' phase is the
    loss function's and its backward ends at the model output's gradient."""
    import types

    import torch

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Linear(4, 4)
            if output_layer:
                self.output_layer = torch.nn.Linear(4, 8)

        def forward(self, x):
            hidden = self.body(x)
            return self.output_layer(hidden) if output_layer else hidden

    def make_loss_func():
        return lambda logits: (logits.logsumexp(-1).sum(), {"metric": 1})

    model, owner = Tiny(), types.SimpleNamespace(make_loss_func=make_loss_func)
    optimizer, clock = torch.optim.SGD(model.parameters(), lr=0.1), RecordingClock()
    with throughput.timed_phases(model, optimizer, clock, loss_owner=owner):
        loss, metrics = owner.make_loss_func()(model(torch.randn(2, 4)))
        loss.backward()
        optimizer.step()
    assert metrics == {"metric": 1}
    logits = ["logits_begin"] if output_layer else []
    logits_end = ["model_output_grad", "logits_backward_end"] if output_layer else ["model_output_grad"]
    assert clock.order == ["forward_begin", *logits, "loss_begin", "loss_end", "backward_begin", *logits_end,
                           "optimizer_begin", "optimizer_end"]
    phases = throughput.phase_seconds(clock, update_s=10.0)
    assert set(phases) == set(throughput.PHASES) and all(value >= 0 for value in phases.values())
    assert phases["forward_s"] >= phases["logits_forward_s"] and phases["other_s"] > 9
    assert owner.make_loss_func is make_loss_func and "step" not in vars(optimizer)
    assert not model._forward_pre_hooks and not model._forward_hooks
    model(torch.randn(2, 4)).sum().backward()  # no gradient hook left to mark
    assert clock.order[-1] == "optimizer_end"


def test_section_9_line_reports_mfu_against_its_target_and_fails_only_on_what_is_not_finite():
    phases = [{key: 0.1 for key in throughput.PHASES}, {key: 0.3 for key in throughput.PHASES}]
    kernels = [{"name": "sm90_xmma_gemm", "ms": 100.0, "calls": 10, "share": 0.5}]
    from gspo_mcore.planner.flops import Flops

    common = dict(tokens=16384, update_s=[0.5, 0.7], phases=phases, flops=Flops(model=60e12, hardware=80e12),
                  report={"loss": 0.0, "grad_norm": 0.5}, kernels=kernels)
    line = throughput.throughput_figures(peak=989e12, cuda=True, **common)
    assert line["update_s"] == pytest.approx(0.6) and line["tokens_per_s"] == pytest.approx(16384 / 0.6)
    assert line["mfu"] == pytest.approx(100.0 / 989.0) and line["mfu_target"] == 0.30
    assert line["hfu"] == pytest.approx(80e12 / 0.6 / 989e12)  # the recomputed forwards: HFU, not MFU
    assert line["mfu_reached"] is False and line["pass"] is True  # below the target: reported, not failed
    assert line["forward_s"] == pytest.approx(0.2) and line["top_kernels"] == kernels
    assert {"logits_s", "backward_s", "optimizer_s", "phases_how", "flops_source", "update_s_each"} <= set(line)
    cpu = throughput.throughput_figures(peak=None, cuda=False, **common)
    assert cpu["mfu"] is None and cpu["hfu"] is None  # CPU: no peak, no MFU
    assert throughput.throughput_figures(peak=None, cuda=False, **common)["pass"] is True
    broken = [{**phases[0], "backward_s": float("nan")}, phases[1]]
    assert throughput.throughput_figures(peak=989e12, cuda=True, **{**common, "phases": broken})["pass"] is False
    assert throughput.throughput_figures(peak=989e12, cuda=True, **{**common, "kernels": []})["pass"] is False
    assert throughput.throughput_figures(peak=989e12, cuda=True,
                                         **{**common, "report": {"loss": None, "grad_norm": 0.5}})["pass"] is False


def test_top_kernels_are_the_device_entries_with_the_most_self_time():
    import types

    from torch.autograd import DeviceType

    def entry(key, kind, self_us):
        return types.SimpleNamespace(key=key, device_type=kind, count=2, self_device_time_total=self_us,
                                     self_cpu_time_total=self_us)

    averages = [entry("aten::mm", DeviceType.CPU, 900.0), entry("k" * 200, DeviceType.CUDA, 300.0),
                entry("Memset (Device)", DeviceType.CUDA, 100.0)]
    top = throughput.top_kernels(averages, cuda=True)
    assert top == [{"name": "k" * throughput.NAME_CHARS, "ms": 0.3, "calls": 2, "share": 0.75},
                   {"name": "Memset (Device)", "ms": 0.1, "calls": 2, "share": 0.25}]
    assert [row["name"] for row in throughput.top_kernels(averages, cuda=False)] == ["aten::mm"]


@pytest.mark.skipif(not hasattr(__import__("torch"), "_grouped_mm"), reason="no torch._grouped_mm")
def test_section_2s_empty_expert_probe_reads_the_raw_kernel_and_the_trainers_gradient():
    """The probe's call run on the host (float32: the host kernel's dtype): both gradients of the
    empty experts read, the trainer's zero."""
    from gpucheck import parity

    figures = parity.empty_group_probe(hidden=16, ffn=24, device="cpu", dtype_name="float32")
    assert figures == {"capability": "cpu", "masked_here": False, "raw_max_abs": 0.0, "trainer_max_abs": 0.0,
                       "pass": True}


# ------------------------------------------------------------------ section 10: the rehearsed step measured

MEASURED = {"phases": {"training": {"peak_gb": 10.0, "static_gb": 4.0}, "sync check": {"peak_gb": 5.0, "static_gb": 4.0}},
            "planner": {"training": 9.8, "sync check": 6.0}, "layers": 2}


def test_section_10_names_the_nearer_figure_and_holds_the_rehearsal_to_its_tolerance():
    near = step_memory.compare(MEASURED, {"phases": {"training": 10.8, "sync check": 5.2}, "mismatches": []})
    assert near["pass"] is True and near["rehearsal_within"] is True and near["layers"] == 2
    assert near["phases"]["training"] == pytest.approx({
        "measured_gb": 10.0, "measured_static_gb": 4.0, "rehearsal_gb": 10.8, "planner_gb": 9.8,
        "rehearsal_over_measured": 1.08, "planner_over_measured": 0.98, "nearer": "planner"})
    assert near["phases"]["sync check"]["nearer"] == "rehearsal"
    far = step_memory.compare(MEASURED, {"phases": {"training": 11.5, "sync check": 5.0}, "mismatches": []})
    assert far["pass"] is False and far["rehearsal_within"] is False and far["phases"]["training"]["nearer"] == "planner"
    slip = step_memory.compare(MEASURED, {"phases": {"training": 10.0, "sync check": 5.0},
                                          "mismatches": ["aten.mm at gspo_mcore/x.py:3: ..."]})
    assert slip["pass"] is False and slip["mismatches"]
    # a rehearsal that failed: the measured peaks and the planner's still printed, the section failed
    failed = step_memory.compare(MEASURED, {"error": "the rehearsal exited with status 2: rehearse: x"})
    assert failed["pass"] is False and failed["rehearsal_error"].startswith("the rehearsal exited")
    assert failed["phases"]["training"]["measured_gb"] == 10.0 and failed["phases"]["training"]["planner_gb"] == 9.8
    assert failed["phases"]["training"]["rehearsal_gb"] is None and failed["rehearsal_within"] is None
    dead = step_memory.compare({"pass": False, "error": "gpucheck.step_memory:measured: the child process was "
                                                      "killed by SIGKILL"}, {"phases": {"training": 1.0}})
    assert dead["pass"] is False and dead["error"].endswith("SIGKILL") and dead["phases"] == {}


def test_section_10_reads_the_rehearse_commands_line_or_says_how_it_ended():
    role = {"phases": {"training": {"peak_gb": 3.0, "by_kind_gb": {"weights": 1.0}},
                       "host": {"peak_gb": 9.0, "by_kind_gb": {}}}, "mismatches": []}
    line = json.dumps({"roles": {"every rank (one stage)": role}, "changes": []})
    ok = subprocess.Popen([sys.executable, "-c", f"print('table'); print({line!r})"], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert step_memory.rehearsal_result(ok, 30) == {"phases": {"training": 3.0}, "by_kind_gb": {
        "training": {"weights": 1.0}}, "mismatches": [], "changes": []}
    bad = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit('rehearse: x.yaml: no such file')"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert step_memory.rehearsal_result(bad, 30) == {
        "error": "the rehearsal exited with status 1: rehearse: x.yaml: no such file"}
    slow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert step_memory.rehearsal_result(slow, 1) == {"error": "the rehearsal ran past 1 s and was killed"}
    assert slow.poll() is not None


@pytest.mark.slow  # ~20 s: the rehearse command's two processes beside one forked child
def test_section_10_measures_the_rehearsals_step_and_the_rehearsal_agrees_on_cpu(tmp_path, monkeypatch):
    """The tiny shape run for real on CPU (a count of real storages) and rehearsed on fake CUDA:
    each phase within 10% (measured ~1%), the static part below the peak, the planner beside."""
    monkeypatch.syspath_prepend(str(REPO / "launch"))
    figures = step_memory.section_10(a_check(tmp_path, children="forkserver"))
    assert figures["pass"] is True, json.dumps(figures)
    assert figures["measured_by"] == "count of real storages (CPU)" and figures["mismatches"] == []
    assert list(figures["phases"]) == ["training", "weight push", "sync check"]
    for row in figures["phases"].values():
        assert 0 < row["measured_static_gb"] < row["measured_gb"] and row["planner_gb"] > 0
        assert abs(row["rehearsal_over_measured"] - 1) <= 0.05


# ------------------------------------------------------------------ the registry

def test_the_order_holds_every_section_once_and_the_parent_imports_nothing_heavy():
    """Numbered 1..N, a full run's order a permutation of them with the deciding sections first;
    importing the check (what the parent of a CPU run does) imports neither torch nor megatron-core."""
    numbers = [section.number for section in registry.SECTIONS]
    assert numbers == list(range(1, len(numbers) + 1)) and sorted(registry.ORDER) == numbers
    assert registry.ORDER[:4] == (1, 6, 2, 9)  # environment, NCCL calls, parity, throughput
    probe = ("import sys; sys.path.insert(0, sys.argv[1]); import gpucheck.main; "
             "print(sorted(m for m in ('torch', 'megatron.core', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe, str(REPO / "launch")], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": ""}, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_a_budget_starts_only_what_fits_caps_the_children_and_names_what_was_left_out(tmp_path, monkeypatch, capsys):
    """With the registry's estimates and sections that take exactly their estimate (a clock of
    their own), --budget 540 runs them in ORDER while each fits what is left, each child's timeout
    at most what was left when it started, and ends with a line naming the ones left out."""
    clock, seen = [0.0], []

    def section(number, estimate):
        def run(check):
            seen.append((number, check.child_timeout_s))
            clock[0] += estimate
            return {"pass": True}
        return run

    monkeypatch.setattr(main, "BY_NUMBER", {n: dataclasses.replace(s, run=section(n, s.estimate_s))
                                            for n, s in registry.BY_NUMBER.items()})
    monkeypatch.setattr(main.time, "perf_counter", lambda: clock[0])
    assert main.main(["--device", "cpu", "--work", str(tmp_path), "--budget", "540", "--child-timeout", "300"]) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    estimates = {n: s.estimate_s for n, s in registry.BY_NUMBER.items()}
    expected, spent = [], 0
    for n in registry.ORDER:
        if estimates[n] <= 540 - spent:
            expected.append((n, min(300, 540 - spent)))
            spent += estimates[n]
    assert seen == expected and len(seen) < len(registry.ORDER)  # the whole check does not fit one call
    left = [n for n in registry.ORDER if n not in dict(seen)]
    assert [line["section"] for line in printed] == [n for n, _ in seen] + ["budget"]
    assert printed[-1]["left_out"] == [{"section": n, "name": registry.BY_NUMBER[n].name,
                                        "estimate_s": estimates[n]} for n in left]
    assert printed[-1]["ran"] == [n for n, _ in seen] and printed[-1]["spent_s"] == spent
    # without --budget every section runs, in ORDER, and no budget line
    seen.clear()
    main.main(["--device", "cpu", "--work", str(tmp_path)])
    assert [n for n, _ in seen] == list(registry.ORDER)
    assert "budget" not in capsys.readouterr().out
