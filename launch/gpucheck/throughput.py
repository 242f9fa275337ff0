"""Section 9: how fast the fast path trains on one GPU (issue #47 item 4). A child process builds
a learner at the 30B config's layer widths with as many layers as fit one H100 beside Adam on the
GPU (`layers_that_fit`: the planner's estimate, gspo_mcore.planner.memory_model.memory_estimate,
with optimizer.cpu_offload=false), `model.spec: torch` and the fused linear log-probs, on the
check's 16k-token microbatch (4 x 4,096 tokens, the 30B config's full recompute), and times the
GSPO update: WARMUP updates first (Adam's states made, kernels chosen), then TIMED ones, then one
more under torch.profiler. Its line: tokens/s, model-FLOPs MFU against MFU_TARGET (below it is
reported, not a failure), the peak minus the baseline against the planner's estimate, the time of
each phase and the top kernels by self time. PASS when it ran and its figures are finite. On CPU
the tiny shape (its 2 layers), the profile's top CPU ops in place of kernels, no MFU.

The phases, timed with CUDA events (wall clock on CPU) recorded by hooks, not by the profiler:
- forward: the model's forward pre-hook to the end of the loss function (the logits and the
  log-probs included);
- backward: the loss's gradient hook (backward's first node) to the optimizer's step: the
  recomputed forward of model.recompute full and the gradient reduction (finalize_model_grads)
  are in it; measured, not derived;
- optimizer: Megatron's optimizer.step (gradient norm and clipping included);
- logits: the output layer and the log-probs, forward (the output layer's pre-hook, or the loss
  function's start where the output layer is not called as a module, to the loss's end) and
  backward (the loss's gradient hook to the gradient of the output layer's input, or of the
  model's output where there is no output-layer call);
- other: the update's host work outside those (packing, the normalizer, the report).

The weights are the model's own random initialisation (megatron-core's init_method, on the
device): the FLOPs and kernels are those of any weights, and writing and loading a synthetic
checkpoint of 3-5 layers at these widths (~4B parameters) would take ~30 s of the check's
8 minutes."""

from __future__ import annotations

import contextlib
import json
import math
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gspo_mcore.planner.flops import Flops

MFU_TARGET = 0.30  # Megatron-Bridge's published Qwen3-30B-A3B figure on H100s (model FLOPs)
WARMUP = 1
TIMED = {"cuda": 3, "cpu": 2}
# Room left on the device beyond the planner's estimate and the trainer's CUDA context: ~10% of
# an H100, for the estimate's own error and the caching allocator's fragmentation (as the
# planner's KV_ROOM_MARGIN_GB).
MARGIN_GB = 8.0
TOP_KERNELS, NAME_CHARS = 10, 80
FAST_SPEC = "torch"
FUSED_LOGPROBS = "model.fused_logprobs"  # the config switch of issue #47 item 2
PHASES = ("forward_s", "backward_s", "optimizer_s", "logits_forward_s", "logits_backward_s", "logits_s", "other_s")


def section_9(check) -> dict:
    return check.child("gpucheck.throughput:measure")


# ------------------------------------------------------------------ the config and the layer count

def schema_has(field: str, value=None) -> bool:
    """Whether `section.name` is a field of the config schema (and `value` one of its Literal's)."""
    import typing

    from gspo_mcore.config import Config

    section, _, name = field.partition(".")
    hints = typing.get_type_hints(Config)
    if section not in hints:
        return False
    fields = typing.get_type_hints(hints[section])
    if name not in fields:
        return False
    return value is None or value in typing.get_args(fields[name])


def fast_path_overrides() -> tuple[list[str], dict]:
    """The section's overrides beyond the check's config (GPU Adam, the torch spec, the fused
    log-probs) and, for any this tree's schema lacks, what ran instead, in words."""
    overrides, notes = ["optimizer.cpu_offload=false"], {}
    if schema_has("model.spec", FAST_SPEC):
        overrides.append(f"model.spec={FAST_SPEC}")
    else:
        notes["spec_note"] = f"model.spec {FAST_SPEC!r} is not in this tree's schema: ran 'local'"
    if schema_has(FUSED_LOGPROBS):
        overrides.append(f"{FUSED_LOGPROBS}=true")
    else:
        notes["fused_logprobs_note"] = f"{FUSED_LOGPROBS} is not in this tree's schema: ran today's log-probs"
    return overrides, notes


def planned(config, hf: dict, layers: int, prompt_tokens: int) -> dict:
    """The planner's estimate for `config` on one GPU at `hf`'s widths and `layers` layers."""
    from gspo_mcore.megatron.qwen3_moe.hf_config import parse_hf_config
    from gspo_mcore.planner.memory_model import check_layout, memory_estimate

    arch = parse_hf_config({**hf, "num_hidden_layers": layers})
    return memory_estimate(config, arch, check_layout(config, arch, 1, 1), prompt_tokens)


def layers_that_fit(config, hf: dict, prompt_tokens: int, device_gb: float, most: int,
                    margin_gb: float = MARGIN_GB) -> int:
    """The largest layer count (at most `most`) at `hf`'s widths whose planner estimate, with the
    trainer's CUDA context and `margin_gb`, fits `device_gb` GiB; one line when none does."""
    from gspo_mcore.planner.memory_model import TRAINER_CONTEXT_GB

    room = device_gb - TRAINER_CONTEXT_GB - margin_gb
    fitting = 0
    for layers in range(1, most + 1):  # the estimate grows with the layers
        if planned(config, hf, layers, prompt_tokens)["trainer_total_gb"] > room:
            break
        fitting = layers
    if not fitting:
        raise RuntimeError(f"not one layer fits: the planner's estimate at 1 layer is over the device's "
                           f"{device_gb:.1f} GiB less {TRAINER_CONTEXT_GB:g} (CUDA context) and {margin_gb:g} (margin)")
    return fitting


def write_hf_config(folder: Path, hf: dict) -> Path:
    """A model folder holding config.json alone (temporary name, then renamed): what the learner
    reads of model.hf_dir when the weights are not loaded."""
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / "config.json.part"
    partial.write_text(json.dumps(hf, indent=2))
    partial.rename(folder / "config.json")
    return folder


# ------------------------------------------------------------------ timing the phases

class PhaseClock:
    """Named marks in the order they happen: CUDA events on the current stream (read once the
    device is synchronised), or the wall clock on CPU."""

    def __init__(self, cuda: bool):
        self.cuda, self.marks = cuda, {}

    def mark(self, name: str) -> None:
        if self.cuda:
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.setdefault(name, []).append(event)
        else:
            self.marks.setdefault(name, []).append(time.perf_counter())

    def has(self, name: str) -> bool:
        return bool(self.marks.get(name))

    def seconds(self, begin: str, end: str) -> float:
        """From each `begin` to its `end` (one pair a microbatch), summed; nan where either is missing."""
        begins, ends = self.marks.get(begin, []), self.marks.get(end, [])
        if not begins or len(begins) != len(ends):
            return math.nan
        if self.cuda:
            return sum(b.elapsed_time(e) for b, e in zip(begins, ends)) / 1000.0
        return sum(e - b for b, e in zip(begins, ends))

    def clear(self) -> None:
        self.marks = {}


def phase_seconds(clock: PhaseClock, update_s: float) -> dict[str, float]:
    """One update's phases from its marks (the module docstring says what each spans)."""
    logits_begin = "logits_begin" if clock.has("logits_begin") else "loss_begin"
    logits_end = "logits_backward_end" if clock.has("logits_backward_end") else "model_output_grad"
    phases = {"forward_s": clock.seconds("forward_begin", "loss_end"),
              "backward_s": clock.seconds("backward_begin", "optimizer_begin"),
              "optimizer_s": clock.seconds("optimizer_begin", "optimizer_end"),
              "logits_forward_s": clock.seconds(logits_begin, "loss_end"),
              "logits_backward_s": clock.seconds("backward_begin", logits_end)}
    phases["logits_s"] = phases["logits_forward_s"] + phases["logits_backward_s"]
    phases["other_s"] = update_s - clock.seconds("forward_begin", "optimizer_end")
    return phases


@contextlib.contextmanager
def timed_phases(model, optimizer, clock: PhaseClock, loss_owner=None):
    """Marks on `clock` while the block runs: hooks on `model` (a GPTModel) and its output layer,
    `optimizer.step` wrapped, and the loss functions that `loss_owner` (default
    gspo_mcore.megatron.learner, whose Learner._optimizer_step calls its `make_loss_func` for each
    microbatch) makes wrapped; all of it undone after. Megatron's forward_backward_func runs the
    forward, the loss and the backward of each microbatch in one call, so the phase boundaries
    are hooks: module hooks for the forward, gradient hooks on tensors for the backward (the
    autograd engine runs them on the stream of the forward: the events land in order)."""
    import torch

    if loss_owner is None:
        import gspo_mcore.megatron.learner as loss_owner

    def when_grad(name):
        def hook(grad):
            clock.mark(name)
        return hook

    def on_grad(tensor, name):
        if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
            tensor.register_hook(when_grad(name))

    def model_begins(module, args):
        clock.mark("forward_begin")

    def model_ends(module, args, output):
        on_grad(output[0] if isinstance(output, tuple) else output, "model_output_grad")

    def logits_begin(module, args):
        clock.mark("logits_begin")
        if args:
            on_grad(args[0], "logits_backward_end")

    handles = [model.register_forward_pre_hook(model_begins), model.register_forward_hook(model_ends)]
    output_layer = getattr(model, "output_layer", None)
    if output_layer is not None:
        handles.append(output_layer.register_forward_pre_hook(logits_begin))
    make_loss_func, step = loss_owner.make_loss_func, optimizer.step
    own_step = vars(optimizer).get("step")  # None: the class's method

    def timed_make_loss_func(*args, **kwargs):
        loss_func = make_loss_func(*args, **kwargs)

        def timed_loss_func(*inputs, **options):
            clock.mark("loss_begin")
            loss, *rest = loss_func(*inputs, **options)
            clock.mark("loss_end")
            on_grad(loss, "backward_begin")
            return (loss, *rest)
        return timed_loss_func

    def timed_step(*args, **kwargs):
        clock.mark("optimizer_begin")
        out = step(*args, **kwargs)
        clock.mark("optimizer_end")
        return out

    loss_owner.make_loss_func, optimizer.step = timed_make_loss_func, timed_step
    try:
        yield clock
    finally:
        loss_owner.make_loss_func = make_loss_func
        if own_step is None:
            del optimizer.step  # the instance's wrapper gone: the class's method again
        else:
            optimizer.step = own_step
        for handle in handles:
            handle.remove()


def top_kernels(averages, cuda: bool, count: int = TOP_KERNELS) -> list[dict]:
    """The `count` entries of a profile's key_averages() (torch.autograd.profiler_util.
    FunctionEventAvg) with the most self time: on CUDA the device's (kernels, copies, memsets:
    device_type CUDA, self_device_time_total), on CPU the host ops' (self_cpu_time_total). Each:
    its name cut to NAME_CHARS, ms in the profiled update, calls, share of that total."""
    from torch.autograd import DeviceType

    kind, attribute = (DeviceType.CUDA, "self_device_time_total") if cuda else (DeviceType.CPU, "self_cpu_time_total")
    rows = [(event.key, getattr(event, attribute), event.count) for event in averages if event.device_type == kind]
    total = sum(us for _, us, _ in rows) or 1.0
    rows.sort(key=lambda row: -row[1])
    return [{"name": name[:NAME_CHARS], "ms": us / 1000.0, "calls": calls, "share": us / total}
            for name, us, calls in rows[:count]]


# ------------------------------------------------------------------ FLOPs and the line

FLOPS_SOURCE = ("gspo_mcore.planner.flops.update_flops: model 6N + causal attention a token (N the active "
                "parameters less the input embedding), hardware + model.recompute's and the fused log-probs' "
                "recomputed forwards")


def all_finite(figures: dict, keys) -> bool:
    return all(isinstance(figures.get(k), (int, float)) and math.isfinite(figures[k]) for k in keys)


def throughput_figures(*, tokens: int, update_s: list[float], phases: list[dict], flops: Flops,
                       peak: float | None, report: dict, kernels: list[dict], cuda: bool) -> dict:
    """The line's figures from what the child measured: each timed update's seconds and phases
    (averaged), the update's model and hardware FLOPs (`mfu`, `hfu` beside it), the last update's
    report, the profile's top entries. PASS: finite figures and a profile with entries; MFU under
    MFU_TARGET is reported (`mfu_reached`), not failed."""
    from gspo_mcore.planner.flops import utilization

    mean = statistics.fmean(update_s)
    figures = {"tokens": tokens, "timed_updates": len(update_s), "warmup_updates": WARMUP,
               "update_s": mean, "update_s_each": update_s, "tokens_per_s": tokens / mean,
               "model_tflops_per_update": flops.model / 1e12, "model_tflops_per_s": flops.model / mean / 1e12,
               "hardware_tflops_per_update": flops.hardware / 1e12, "flops_source": FLOPS_SOURCE,
               "peak_tflops": peak / 1e12 if peak else None, "mfu_target": MFU_TARGET,
               "loss": report.get("loss"), "grad_norm": report.get("grad_norm"),
               **{key: statistics.fmean(p[key] for p in phases) for key in PHASES},
               "phases_how": "CUDA events from hooks (wall clock on CPU): forward = model pre-hook to the loss's "
                             "end; backward = the loss's gradient hook to optimizer.step (recompute and gradient "
                             "reduction in it); logits = output layer + log-probs, forward and backward",
               "top_kernels_of": "CUDA kernels (self device time)" if cuda else "CPU ops (self CPU time)",
               "top_kernels": kernels}
    figures["mfu"], figures["hfu"] = (utilization(count, mean, 1, peak) for count in (flops.model, flops.hardware))
    figures["mfu_reached"] = figures["mfu"] >= MFU_TARGET if figures["mfu"] is not None else None
    figures["pass"] = (all_finite(figures, ("update_s", "tokens_per_s", "model_tflops_per_s", "loss", "grad_norm",
                                            *PHASES))
                       and (figures["mfu"] is None or math.isfinite(figures["mfu"])) and bool(kernels))
    return figures


# ------------------------------------------------------------------ the child

@contextlib.contextmanager
def random_weights():
    """The learner's model built without loading model.hf_dir's weights (see the module
    docstring): gspo_mcore.megatron.learner's `model_from_config` (bootstrap's) with load_weights off."""
    import functools

    import gspo_mcore.megatron.learner as learner_module
    from gspo_mcore.megatron.qwen3_moe.bootstrap import model_from_config

    kept = learner_module.model_from_config
    learner_module.model_from_config = functools.partial(model_from_config, load_weights=False)
    try:
        yield
    finally:
        learner_module.model_from_config = kept


def profiled_update(learner, shape, cuda: bool, step: int) -> list[dict]:
    """One more update under torch.profiler; its top entries (`top_kernels`)."""
    from torch.profiler import ProfilerActivity, profile

    from gpucheck.shape import update_once

    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as profiler:
        update_once(learner, shape, step)
    return top_kernels(profiler.key_averages(), cuda)


def measure(check) -> dict:
    """The child: the section's config and layer count, the learner, WARMUP + TIMED timed updates
    and a profiled one; its figures (`throughput_figures`, the layer count, the memory)."""
    import torch

    from checkpoint_convert.synthetic import QWEN3_30B_A3B
    from gpucheck.shape import check_config, update_once
    from gpucheck.updates import memory_figures
    from gspo_mcore.megatron.learner import Learner
    from gspo_mcore.megatron.qwen3_moe.hf_config import parse_hf_config
    from gspo_mcore.planner.flops import peak_flops, update_flops
    from gspo_mcore.planner.memory_model import ESTIMATE_TOLERANCE, GB

    shape, cuda = check.shape, check.device == "cuda"
    extra, notes = fast_path_overrides()
    hf_dir = check.work / f"throughput_{check.device}"
    config = check_config(check.work, shape, hf_dir, "bfloat16", extra)
    if cuda:
        torch.cuda.init()
        device_gb = torch.cuda.get_device_properties(0).total_memory / GB
        layers = layers_that_fit(config, shape.hf, shape.prompt, device_gb, QWEN3_30B_A3B["num_hidden_layers"])
        layers_from = (f"planner: the most whose estimate fits {device_gb:.1f} GiB less the CUDA context and a "
                       f"{MARGIN_GB:g} GiB margin")
    else:
        device_gb, layers, layers_from = None, shape.hf["num_hidden_layers"], "the tiny shape (CPU)"
    hf = {**shape.hf, "num_hidden_layers": layers}
    write_hf_config(hf_dir, hf)
    arch = parse_hf_config(hf)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated() if cuda else None
    with random_weights():
        learner = Learner(config)
    with learner:
        for step in range(1, WARMUP + 1):
            update_once(learner, shape, step)
        clock, seconds, phases = PhaseClock(cuda), [], []
        with timed_phases(learner.model, learner.optimizer, clock):
            for step in range(WARMUP + 1, WARMUP + TIMED[check.device] + 1):
                clock.clear()
                report, took = update_once(learner, shape, step)
                seconds.append(took)
                phases.append(phase_seconds(clock, took))
        peak = torch.cuda.max_memory_allocated() if cuda else None
        kernels = profiled_update(learner, shape, cuda, WARMUP + TIMED[check.device] + 1)
    # The dense bf16 FLOP/s (None: CPU, or a GPU not in the table: no MFU); `peak` is the memory's
    device_flops = peak_flops(torch.cuda.get_device_name()) if cuda else None
    figures = throughput_figures(tokens=shape.tokens, update_s=seconds, phases=phases,
                                 flops=update_flops(config, arch, shape.lengths),  # the update alone
                                 peak=device_flops, report=report,
                                 kernels=kernels, cuda=cuda)
    memory = memory_figures(planned(config, shape.hf, layers, shape.prompt), ESTIMATE_TOLERANCE, baseline, peak)
    return {"layers": layers, "layers_from": layers_from, "device_gb": device_gb, "overrides": extra, **notes,
            "spec": config.model.spec, "recompute": config.model.recompute, "microbatch_tokens": shape.tokens,
            "device_name": torch.cuda.get_device_name() if cuda else "cpu", **memory, **figures}
