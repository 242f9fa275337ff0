"""python -m gspo_mcore.rehearse --config FILE [--hf-config config.json] [--layers N] [--nodes N]
   [--rank R] [--imbalance X] [key=value ...]

The config's training step rehearsed on CPU at its real shapes: one rank of its layout (by default
each distinct role: the first and the last pipeline stage, each the busiest expert rank of the
routing plan) runs the production Learner on fake CUDA devices in a fake world of the config's
size: two optimizer steps of one full microbatch at train.max_tokens_per_microbatch and one of the
longest sequence alone, the weight push's gather-and-pack of one bucket, the sync check's forward.
Prints per phase the peak bytes by kind beside the planner's (gspo_mcore.planner.memory_model) and
their ratio, the FLOPs by kind beside gspo_mcore.planner.flops, and every device or dtype mismatch
met (one line each, exit 1), then one JSON line. Each role runs in a process of its own: the fake
devices are loaded before torch (gspo_mcore.rehearsal.device).

The `te` spec and the precision-aware optimizer cannot run here (no Transformer Engine on CPU):
such a config is rehearsed with the torch spec and GPU Adam, and says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

GB = 1024**3


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gspo_mcore.rehearse", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--hf-config", help="the model's config.json (default: model.hf_dir/config.json)")
    parser.add_argument("--layers", type=int, help="decoder layers (default: the model's)")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--rank", type=int, action="append", help="a rank to rehearse (default: each distinct role)")
    parser.add_argument("--imbalance", type=float, default=2.0,
                        help="the rehearsed expert rank receives this many times its share (default 2)")
    parser.add_argument("--json-only", action="store_true", help=argparse.SUPPRESS)  # a role's child process
    parser.add_argument("overrides", nargs="*")
    return parser


def _setup(args):
    """(the rehearsable config, its changes, arch, layout, the config.json used): no torch."""
    from gspo_mcore.config import ConfigError, load_config
    from gspo_mcore.megatron.qwen3_moe.hf_config import load_hf_config
    from gspo_mcore.rehearsal.step import hf_config_file, rehearsable
    from gspo_mcore.planner.memory_model import check_layout

    config = load_config(args.config, args.overrides)
    source = Path(args.hf_config or Path(config.model.hf_dir) / "config.json")
    if not source.is_file():
        raise ConfigError(f"{source}: config.json not found; give the model's: --hf-config "
                          "configs/hf/<model>.config.json")
    config, changes = rehearsable(config)
    out_dir = Path(tempfile.mkdtemp(prefix="gspo-rehearse-"))
    hf = hf_config_file(source, args.layers, out_dir)
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, hf_dir=str(hf), mcore_dir=""),
                                 distributed=dataclasses.replace(config.distributed, device="cuda"))
    arch = load_hf_config(hf)
    layout = check_layout(config, arch, args.nodes, args.gpus_per_node)
    return config, changes, arch, layout


def roles(config, layout) -> dict[str, int]:
    """Distinct ranks: megatron's order (tp-cp-ep-dp-pp) puts the pipeline outermost, so rank 0
    is the first stage and the last rank the last stage; each is the plan's busiest expert rank."""
    if config.distributed.pipeline_parallel == 1:
        return {"every rank (one stage)": 0}
    return {"first pipeline stage": 0, "last pipeline stage": layout.trainer_gpus - 1}


def planner_phases(config, arch, layout) -> dict[str, dict[str, float]]:
    """The planner's trainer bytes per phase by kind (the colocated engine's share left out: the
    rehearsal runs the trainer only)."""
    from gspo_mcore.planner.memory_model import memory_estimate
    from gspo_mcore.rehearsal.phases import PROMPT_TOKENS

    memory = memory_estimate(config, arch, layout, PROMPT_TOKENS)
    static = {"weights": memory["trainer_weights_gb"], "gradients": memory["trainer_gradients_gb"],
              "optimizer": memory["trainer_optimizer_gb"]}
    engine_phase = dict(static)
    if config.optimizer.offload_grad_buffers:
        engine_phase["gradients"] = 0.0
    phases = {"training": {**static, "activations": memory["trainer_total_gb"] - memory["trainer_static_gb"]},
              "weight push": {**engine_phase, "activations": config.weight_sync.bucket_mb / 1024 * 2},
              "sync check": {**engine_phase, "activations": memory["trainer_check_forward_gb"]}}
    out = {phase: {kind: gb * GB for kind, gb in kinds.items()} for phase, kinds in phases.items()}
    for kinds in out.values():
        kinds["total"] = sum(kinds.values())
    if "host_optimizer_gb_per_gpu" in memory:
        out["host"] = {"optimizer": memory["host_optimizer_gb_per_gpu"] * GB,
                       "total": memory["host_optimizer_gb_per_gpu"] * GB}
    return out


def rank_main(args) -> dict:
    """In this process: the fake devices, then one rank's rehearsal; its figures as a dict."""
    from gspo_mcore.rehearsal import device

    device.load()
    from gspo_mcore.rehearsal.mode import Mismatch
    from gspo_mcore.rehearsal.phases import StepShape, run_step
    from gspo_mcore.rehearsal.plan import RoutingPlan
    from gspo_mcore.rehearsal.step import RankRehearsal

    config, changes, arch, layout = _setup(args)
    rank = args.rank[0]
    d = config.distributed
    plan = RoutingPlan(arch.num_experts, arch.num_experts_per_tok, d.expert_parallel, d.expert_tensor_parallel,
                       args.imbalance)
    widths = {arch.moe_intermediate_size // d.expert_tensor_parallel, 2 * arch.moe_intermediate_size // d.expert_tensor_parallel}
    out = {"rank": rank, "changes": changes, "imbalance": plan.effective_imbalance(), "mismatches": []}
    rehearsal = RankRehearsal(config, rank, layout.trainer_gpus, plan, arch.vocab_size // d.tensor_parallel, widths)
    try:
        with rehearsal:
            rehearsal.build()
            run_step(rehearsal.learner, config, arch, layout.dp, rehearsal.phase)
    except Mismatch as error:
        out["mismatches"].append(str(error))
    out["phases"] = {name: dataclasses.asdict(figures) for name, figures in rehearsal.phases.items()}
    for figures in out["phases"].values():
        figures["by_site"] = dict(sorted(figures["by_site"].items(), key=lambda kv: -kv[1])[:12])
    out["unanswered"] = rehearsal.mode.unanswered
    out["blocking_copies"] = rehearsal.mode.blocking_copies
    full_step = [figures for name, figures in rehearsal.runs if name == "training"][1:2]
    out["flops"] = full_step[0].flops if full_step else None
    # Where the host waits on the device (GPU syncs), by line: in a full microbatch's update (the
    # second: the first also builds Adam's state) and in the engine's phases.
    waits = {"update": full_step[0].host_waits if full_step else {}}
    waits.update({name: figures.host_waits for name, figures in rehearsal.phases.items() if name != "training"})
    out["host_waits"] = {phase: dict(sorted(lines.items(), key=lambda kv: -kv[1])) for phase, lines in waits.items()}
    from megatron.core import parallel_state

    out["last_stage"] = parallel_state.is_pipeline_last_stage()
    out["step_tokens"] = StepShape.of(config).step_tokens
    return out


def _run_role(argv: list[str], rank: int) -> dict:
    command = [sys.executable, *(["-S"] if sys.flags.no_site else []), "-m", "gspo_mcore.rehearse", *argv,
               "--json-only", "--rank", str(rank)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        tail = [line for line in done.stderr.strip().splitlines() if line.strip()][-1:] or ["no output"]
        raise SystemExit(f"rehearse: rank {rank} failed: {tail[0][-400:]}")
    return json.loads(lines[-1])


def report(config, changes, arch, layout, results: dict[str, dict]) -> dict:
    planned = planner_phases(config, arch, layout)
    out = {"config": None, "layers": arch.num_layers, "world": layout.trainer_gpus, "changes": changes, "roles": {}}
    for role, result in results.items():
        phases = {}
        for phase, figures in result["phases"].items():
            plan = planned[phase]["total"]
            phases[phase] = {"peak_gb": figures["peak_bytes"] / GB, "planner_gb": plan / GB,
                             "ratio": figures["peak_bytes"] / plan if plan else None,
                             "by_kind_gb": {k: v / GB for k, v in figures["by_kind"].items() if v},
                             "planner_by_kind_gb": {k: v / GB for k, v in planned[phase].items() if k != "total"},
                             "top_sites_gb": {k: v / GB for k, v in figures["by_site"].items()}}
        if "host" in planned:  # an offloaded optimizer's host memory, at its largest over the phases
            host = max(figures["host_peak_bytes"] for figures in result["phases"].values())
            phases["host"] = {"peak_gb": host / GB, "planner_gb": planned["host"]["total"] / GB,
                              "ratio": host / planned["host"]["total"], "by_kind_gb": {}, "planner_by_kind_gb": {},
                              "top_sites_gb": {}}
        out["roles"][role] = {"rank": result["rank"], "phases": phases, "mismatches": result["mismatches"],
                              "unanswered": result["unanswered"], "blocking_copies": result["blocking_copies"],
                              "host_waits": result["host_waits"],
                              "imbalance": result["imbalance"],
                              "flops": _flops_of(config, arch, result)}
    return out


def _flops_of(config, arch, result) -> dict | None:
    """The second step's FLOPs by kind (a full microbatch; the first step also builds Adam's state)
    beside the planner's for the same sequences at the plan's expert share."""
    from gspo_mcore.planner.flops import flops_by_kind

    if result["flops"] is None:
        return None
    planned = flops_by_kind(config, arch, result["step_tokens"][1], expert_share=result["imbalance"],
                            last_stage=result["last_stage"])
    return {"rehearsal": result["flops"], "planner": planned,
            "ratio": {k: result["flops"][k] / v if v else None for k, v in planned.items()}}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if args.json_only:
        print(json.dumps(rank_main(args)))
        return 0
    from gspo_mcore.common.errors import InputError

    try:
        config, changes, arch, layout = _setup(args)
    except InputError as error:  # a config's, a config.json's
        print(f"rehearse: {error}", file=sys.stderr)
        return 2
    wanted = {f"rank {r}": r for r in args.rank} if args.rank else roles(config, layout)
    results = {role: _run_role(argv, rank) for role, rank in wanted.items()}
    summary = report(config, changes, arch, layout, results)
    summary["config"] = args.config
    print(format_table(summary))
    print(json.dumps(summary))
    return 1 if any(r["mismatches"] for r in summary["roles"].values()) else 0


def format_table(summary: dict) -> str:
    lines = [f"rehearsal of {summary['config']}: {summary['layers']} layers, a world of {summary['world']}"]
    lines += [f"  (rehearsed as: {change})" for change in summary["changes"]]
    for role, figures in summary["roles"].items():
        lines.append(f"{role} (rank {figures['rank']}, expert imbalance {figures['imbalance']:.2f}):")
        lines.append(f"  {'phase':<12} {'peak GiB':>9} {'planner':>8} {'ratio':>6}  by kind (GiB)")
        for phase, p in figures["phases"].items():
            kinds = ", ".join(f"{k} {v:.2f}" for k, v in p["by_kind_gb"].items())
            ratio = f"{p['ratio']:.2f}" if p["ratio"] else "-"
            lines.append(f"  {phase:<12} {p['peak_gb']:9.2f} {p['planner_gb']:8.2f} {ratio:>6}  {kinds}")
        flops = figures["flops"]
        if flops:
            lines.append("  FLOPs of a full microbatch's step (rehearsal / planner): " + ", ".join(
                f"{k} {flops['rehearsal'][k]:.3e} / {flops['planner'][k]:.3e}" for k in flops["rehearsal"]))
        for mismatch in figures["mismatches"]:
            lines.append(f"  MISMATCH {mismatch}")
        if figures["unanswered"]:
            lines.append("  host reads answered 0: " + ", ".join(figures["unanswered"]))
        if figures["blocking_copies"]:
            lines.append("  host-to-device copies the host waits on (line: count): " + ", ".join(
                f"{line}: {count}" for line, count in figures["blocking_copies"].items()))
        for phase, waits in figures["host_waits"].items():
            if waits:
                lines.append(f"  the host waits on the device (GPU syncs), {phase}, {sum(waits.values())} "
                             "(line: count): " + ", ".join(f"{line}: {count}" for line, count in waits.items()))
    return "\n".join(lines)


def cli() -> None:
    sys.exit(main())
