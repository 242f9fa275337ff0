"""The rehearsal (gspo_mcore.rehearsal): the routing plan and the FLOPs by kind as pure functions;
the fake device's process-level checks (planted GPU-only slips named at their lines); every GPU
config's step rehearsed at the 30B widths with 2 layers (slow), its FLOPs equal to the planner's."""

import json
import subprocess
import sys

import pytest

from helpers import GPU_CONFIGS, HF_30B, REPO, environment
from gspo_mcore.config import load_config
from gspo_mcore.megatron.qwen3_moe.hf_config import load_hf_config
from gspo_mcore.planner.flops import flops_by_kind, update_flops
from gspo_mcore.planner.memory_model import EXPERT_IMBALANCE, expert_imbalance
from gspo_mcore.rehearsal.plan import RoutingPlan, spread



def test_spread_sums_and_stays_even():
    assert spread(10, 4) == [3, 3, 2, 2]
    assert sum(spread(262_143, 8)) == 262_143


@pytest.mark.parametrize("ep, imbalance", [(8, 2.0), (8, 1.0), (4, 3.0), (1, 2.0)])
def test_the_dispatcher_counts_are_one_consistent_routing(ep, imbalance):
    plan = RoutingPlan(num_experts=128, topk=8, expert_parallel=ep, imbalance=imbalance)
    tokens = 16_384
    counts = plan.dispatcher_counts(tokens)
    assert counts["input_splits"].sum() == tokens * 8  # every copy of this rank's tokens is sent
    received = counts["output_splits"].sum()
    assert received == plan.received(tokens) == counts["tokens_per_expert"].sum() == counts["output_splits_tp"][0]
    assert counts["num_global_tokens_per_local_expert"].shape == (ep, 128 // ep)
    assert received == pytest.approx(tokens * 8 * plan.effective_imbalance(), rel=1e-3)
    # what permute's masked_select takes: k per token over all experts, one per received copy locally
    assert plan.masked_count((128, tokens)) == tokens * 8
    if ep > 1:
        assert plan.masked_count((128 // ep, received)) == received
    assert plan.masked_count((3, 5, 7)) is None


@pytest.mark.parametrize("overrides", [[], ["distributed.expert_parallel=1"], ["distributed.expert_parallel=4"]])
def test_the_plans_imbalance_is_the_planners(overrides):
    """The plan's default (2x) capped as the planner caps it: what a rank can receive."""
    config, arch = load_config(REPO / "configs/qwen3_30b_a3b_gspo.yaml", overrides), load_hf_config(HF_30B)
    plan = RoutingPlan(arch.num_experts, arch.num_experts_per_tok, config.distributed.expert_parallel,
                       imbalance=EXPERT_IMBALANCE)
    assert plan.effective_imbalance() == pytest.approx(expert_imbalance(config, arch))
    assert RoutingPlan(128, 8, 8, imbalance=50.0).effective_imbalance() == 8.0  # at most k copies a token


@pytest.mark.parametrize("overrides", [[], ["model.recompute=none"], ["model.fused_logprobs=false"]])
def test_flops_by_kind_add_up_to_the_planners_hardware_flops(overrides):
    """One microbatch's FLOPs by kind (what the rehearsal compares op by op) are the planner's
    hardware count of one update over the same sequences, split (TP 1, balanced experts)."""
    config = load_config(REPO / "configs/qwen3_30b_a3b_gspo.yaml", ["train.ppo_epochs=1", *overrides])
    arch = load_hf_config(HF_30B)
    lengths = [4096, 4096, 3000, 512]
    kinds = flops_by_kind(config, arch, lengths)
    assert sum(kinds.values()) == pytest.approx(update_flops(config, arch, lengths).hardware, rel=1e-12)
    doubled = flops_by_kind(config, arch, lengths, expert_share=2.0)
    assert doubled["experts"] == pytest.approx(2 * kinds["experts"]) and doubled["dense"] == kinds["dense"]


@pytest.mark.slow
def test_planted_gpu_slips_are_named_at_their_lines():
    """A CPU tensor into a device op, int64 or host grouped-GEMM offsets, a float32 activation into a
    bf16 GEMM: each in a copy of a project function, each named with the op and the copy's line; a
    host-to-device copy from pageable memory listed by its line, a pinned non-blocking one not;
    the honest copies run through; without the rehearsal's mode the dtype slip passes (the meta
    kernels check none), which is why the mode checks it."""
    done = subprocess.run([sys.executable, str(REPO / "tests/workers/rehearsal_slips.py")], capture_output=True,
                          text=True, env=environment(), timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["honest"] == [None, None, None]
    worker = "tests/workers/rehearsal_slips.py"
    assert found["offsets on the host"].startswith(f"_grouped_mm at {worker}:32: offsets on cpu")
    assert found["int64 offsets"].startswith(f"_grouped_mm at {worker}:32: offsets are torch.int64")
    assert found["float32 into bf16"].startswith(f"mm.default at {worker}:41: operands float32 x bfloat16")
    assert found["host tensor into a device op"].startswith(f"add.Tensor at {worker}:45:")
    assert found["float32 into bf16 without the mode"] is None
    # host-to-device copies the host waits on, by line: pageable (non_blocking or not); pinned is not one
    assert found["blocking copies"] == {f"{worker}:19": 1, f"{worker}:54": 1}
    # device-to-host reads the host waits on: once each, a .tolist() once; a non-blocking copy none
    source = (REPO / worker).read_text().splitlines()
    assert found["host waits"] == {f"{worker}:{n}": 1 for n, line in enumerate(source, 1) if "# waits" in line}


def _allocator_peak(step) -> tuple[int, int, int, int]:
    """(the host allocator's peak and final bytes by torch.profiler's memory events, the rehearsal
    counter's peak and final bytes) over one run of `step`."""
    from torch.profiler import ProfilerActivity, profile

    from gspo_mcore.rehearsal.memory import Counter, RealCounting

    counter = Counter("cpu")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with RealCounting(counter):
            kept = step()
    counted_end = counter.live  # while `kept` (the gradients) lives, as at the profile's end
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    del kept
    return peak, live, counter.peak.bytes, counted_end


def test_the_live_count_is_the_allocators_at_a_tiny_shape():
    """The storage count (gspo_mcore.rehearsal.memory, what the rehearsal's peaks are) against the
    CPU allocator's own record over a real step of project code: the fused
    log-probs' forward and backward over an expert grouped GEMM's output (views, in-place
    accumulation, saved tensors, a custom autograd function with a Python backward)."""
    import torch

    from gspo_mcore.gspo.logprobs import LinearLogits, token_logprobs
    from gspo_mcore.megatron.qwen3_moe.experts import expert_offsets, grouped_matmul

    def step():
        generator = torch.Generator().manual_seed(0)
        tokens, hidden, vocab, experts = 96, 32, 500, 4
        x = torch.randn(tokens, hidden, generator=generator, requires_grad=True)
        w = torch.randn(experts, hidden, hidden, generator=generator, requires_grad=True)
        head = torch.randn(vocab, hidden, generator=generator, requires_grad=True)
        offsets = expert_offsets(torch.tensor([30, 0, 50, 16]), x.device)
        h = torch.tanh(grouped_matmul(x, w, offsets))
        target = torch.randint(0, vocab, (tokens,), generator=generator)
        logprobs, _ = token_logprobs(LinearLogits(h, head), target, chunk_elements=4096)
        (-logprobs.mean()).backward()
        return x.grad, w.grad, head.grad

    allocator_peak, allocator_end, counted_peak, counted_end = _allocator_peak(step)
    assert allocator_peak > 100_000
    # Every storage an op returns is counted; what a kernel allocates for itself and frees before
    # returning (a Python scalar wrapped as a tensor, a reduction's scratch) is not: 384 bytes here.
    assert 0 <= allocator_peak - counted_peak <= 1024
    assert counted_end == allocator_end


def _rehearse_rank(config: str, nodes: int, hf, rank: int) -> dict:
    args = ["--config", str(REPO / "configs" / config), "--hf-config", str(hf), "--layers", "2", "--nodes", str(nodes)]
    done = subprocess.run([sys.executable, "-m", "gspo_mcore.rehearse", *args, "--json-only", "--rank", str(rank)],
                          capture_output=True, text=True, env=environment(), timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _roles(config: str, nodes: int, hf) -> list[tuple[str, int]]:
    from gspo_mcore.rehearsal.cli import _parser, _setup, roles

    setup = _setup(_parser().parse_args(["--config", str(REPO / "configs" / config), "--hf-config", str(hf),
                                         "--layers", "2", "--nodes", str(nodes)]))
    return [(config, rank) for rank in roles(setup[0], setup[3]).values()]


ROLES = [role for config, (nodes, hf) in GPU_CONFIGS.items() for role in _roles(config, nodes, hf)]


@pytest.mark.slow
@pytest.mark.parametrize("config, rank", ROLES)
def test_every_gpu_config_rehearsed_at_the_30b_widths_with_2_layers(config, rank):
    """Each GPU config's every rank role: the production step at its real widths (2 layers), two
    optimizer steps of a full microbatch and the longest sequence, one bucket's gather-and-pack,
    the sync check's forward. No device or dtype mismatch; no blocking host-to-device copy in the
    MoE layers or of the microbatch, no host wait of this project's per layer; the static state
    equal to the planner's; FLOPs by kind within 1% of the planner's; nothing of the last
    microbatch kept into the engine's phases (the dispatchers' state: 0.15 GiB at 2 layers before
    it was released); the training peak within the planner's error at this depth (its layer
    transient: 1.12-1.17 at 2 layers, within 1.07 at 48: docs/08-gpu.md)."""
    from gspo_mcore.rehearsal.cli import _parser, _setup, report

    nodes, hf = GPU_CONFIGS[config]
    args = _parser().parse_args(["--config", str(REPO / "configs" / config), "--hf-config", str(hf), "--layers", "2",
                                 "--nodes", str(nodes)])
    setup = _setup(args)
    result = _rehearse_rank(config, nodes, hf, rank)
    assert result["mismatches"] == []
    # no host wait per layer or per microbatch: the expert counts and the microbatch go pinned and
    # non-blocking (what remains is a count or a norm read back right after anyway)
    assert not [line for line in result["blocking_copies"] if "experts.py" in line or "parallel.py" in line]
    # the project's host waits in an update: each line once (at 2 layers, one per layer would read 2)
    ours = {line: n for line, n in result["host_waits"]["update"].items() if line.startswith("gspo_mcore/")}
    assert ours and set(ours.values()) == {1}, ours
    summary = report(*setup, {"rank": result})["roles"]["rank"]
    training = summary["phases"]["training"]
    for kind in ("weights", "gradients", "optimizer"):
        assert training["by_kind_gb"].get(kind, 0.0) == pytest.approx(training["planner_by_kind_gb"][kind], rel=5e-3,
                                                                        abs=1e-3), kind
    assert 0.9 < training["ratio"] < 1.25
    for phase in ("weight push", "sync check"):  # the last microbatch's layer inputs and their gradients
        kept = [site for site in summary["phases"][phase]["top_sites_gb"] if site.startswith("other static")
                and ("random.py:566" in site or "fused_bias_dropout.py" in site)]
        if setup[0].distributed.pipeline_parallel == 1:  # (a later stage keeps its received input's gradient)
            assert kept == [], phase
        # what stays is megatron's global buffer (sequence parallel's gathers) and the pipeline's
        assert summary["phases"][phase]["by_kind_gb"].get("other static", 0.0) < 0.15
    if "host" in summary["phases"]:
        assert summary["phases"]["host"]["ratio"] == pytest.approx(1.0, abs=0.01)
    from gspo_mcore.planner.flops import flops_by_kind

    planned = flops_by_kind(setup[0], setup[2], result["step_tokens"][1], expert_share=result["imbalance"],
                            last_stage=result["last_stage"])
    for kind, value in planned.items():
        assert result["flops"][kind] == pytest.approx(value, rel=0.01), kind


@pytest.mark.parametrize("argv, message", [
    (["--config", "configs/qwen3_30b_a3b_gspo.yaml"], "config.json not found; give the model's: --hf-config"),
    (["--config", "configs/qwen3_30b_a3b_gspo.yaml", "--hf-config", str(HF_30B), "train.no_such_key=1"],
     "train.no_such_key"),
    (["--config", "configs/no_such.yaml", "--hf-config", str(HF_30B)], "no_such.yaml"),
    (["--config", "configs/qwen3_30b_a3b_gspo.yaml", "--hf-config", str(REPO / "configs/qwen3_30b_a3b_gspo.yaml")],
     "qwen3_30b_a3b_gspo.yaml: not valid JSON"),
])
def test_bad_input_is_one_line_naming_it(argv, message, capsys):
    """Before any process starts: the missing config.json, an unknown key, a missing config, a
    config.json that is not one."""
    from gspo_mcore.rehearsal.cli import main

    code = main(argv)
    text = capsys.readouterr().err.strip()
    assert code == 2 and message in text and len(text.splitlines()) == 1, text


def test_on_a_cuda_build_the_real_device_stays_and_only_the_memory_figures_are_the_counts(monkeypatch):
    """A CUDA build without a device is refused in one line; with one (the GPU check's section 10)
    nothing is built or loaded, torch.cuda is the runtime's but for the memory figures, which the
    rehearsal's counter answers."""
    import torch

    from gspo_mcore.rehearsal import device, memory

    monkeypatch.setattr(device, "_loaded", False)
    monkeypatch.setattr(device, "cuda_build", lambda: True)
    monkeypatch.setattr(device, "build", lambda: pytest.fail("nothing is built on a CUDA build"))
    with pytest.raises(device.RehearsalError, match="a CUDA build and sees no CUDA device"):
        device.load()
    for name in ("is_available", "memory_allocated", "max_memory_allocated", "memory_reserved",
                 "max_memory_reserved", "reset_peak_memory_stats", "get_device_name"):
        monkeypatch.setattr(torch.cuda, name, getattr(torch.cuda, name))  # restored after the test
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    name_before = torch.cuda.get_device_name
    monkeypatch.setattr(memory, "_COUNTER", None)
    device.load()
    counter = memory.Counter("cuda").install()
    counter.live, counter.peak = 3 << 20, memory.Peak(5 << 20)
    assert torch.cuda.memory_allocated() == 3 << 20 and torch.cuda.max_memory_allocated() == 5 << 20
    torch.cuda.reset_peak_memory_stats()
    assert torch.cuda.max_memory_allocated() == 3 << 20
    assert torch.cuda.get_device_name is name_before  # the runtime's


def test_the_fake_device_library_is_keyed_by_where_its_torch_lies(tmp_path, monkeypatch):
    """Its runpath names torch's lib folder: a torch reached through a folder of links (the GPU check's
    bare-machine test) resolves to the installed one and shares its library; the same wheel
    elsewhere gets its own. Before, a library built through a test's links kept a runpath into the
    test's temporary folder, and every later rehearsal failed: libc10.so: cannot open."""
    import importlib.util
    from types import SimpleNamespace

    from gspo_mcore.rehearsal import device

    installed = device._torch_dir()
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "torch").symlink_to(installed)
    copy = tmp_path / "elsewhere" / "torch"
    (copy / "lib").mkdir(parents=True)
    (copy / "version.py").write_bytes((installed / "version.py").read_bytes())
    with open(copy / "lib" / "libtorch_cpu.so", "wb") as wheel:  # the same size, sparse
        wheel.truncate((installed / "lib" / "libtorch_cpu.so").stat().st_size)
    find_spec = importlib.util.find_spec

    def torch_at(folder):
        monkeypatch.setattr(importlib.util, "find_spec", lambda name: SimpleNamespace(
            submodule_search_locations=[str(folder)]) if name == "torch" else find_spec(name))
        return device._torch_dir(), device.library_path()

    here = device.library_path()
    assert torch_at(tmp_path / "site" / "torch") == (installed, here)
    assert torch_at(copy) == (copy, device.library_path()) and device.library_path() != here
