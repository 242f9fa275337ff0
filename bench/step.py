"""Step time with the engine's log-probs vs `train.recompute_old_logprobs`, on the same batches.

    python bench/step.py [--config configs/long_cpu.yaml] [--steps 6] [--smoke] [key=value ...]
    torchrun --nproc_per_node N bench/step.py ...

`--smoke`: one measured step of a small batch (every phase still timed), for the suite's check
that the bench runs; `rollout.urls=[URL]` uses a running server instead of starting one.

One run of the real trainer (`Trainer`: its server, its learner, its weight push). Each step
generates one rollout batch and trains on it twice: once as the default does (pi_old = the
engine's log-probs) and once recomputing pi_old with a trainer forward first, alternating
which goes first; the rollout and the push are shared (they are the same in both arms). The
first step is a warm-up and not counted. Prints per step and per arm the phase times, then a
table of each phase's share, and last one JSON line:
`{"step_time_ratio": engine / recompute, "train_time_ratio": ..., ...}`. Not a test: the
machine is noisy, so both arms run side by side in one process.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
# --smoke: a small batch of short responses, one server, no evaluation.
SMOKE = ["train.rollout_batch_size=2", "train.group_size=4", "rollout.max_new_tokens=16", "rollout.num_servers=1",
         "eval.datasets=[]", "train.num_minibatches=2"]


def main() -> None:
    import torch.distributed as dist

    from gspo_mcore.config import load_config
    from gspo_mcore.run.trainer import Trainer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "long_cpu.yaml"))
    parser.add_argument("--steps", type=int, default=6, help="measured steps (after one warm-up step)")
    parser.add_argument("--smoke", action="store_true", help="one measured step of a small batch")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    import os

    os.chdir(REPO)  # the configs' paths are relative to the repository
    steps, small = (1, SMOKE) if args.smoke else (args.steps, [])
    config = load_config(args.config, [*small, *args.overrides, "train.recompute_old_logprobs=false",
                                       "weight_sync.check_every=0", "train.save_every=0"])
    if Path(args.config).resolve() == (REPO / "configs" / "long_cpu.yaml").resolve():
        from gspo_mcore.tasks.long import make_long_task

        make_long_task(Path(config.model.hf_dir).parent)
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(config, Path(out))
        rows = []
        with trainer.stack:
            for step in range(steps + 1):
                rows.append(measure(trainer, step))
        rows = rows[1:]
    if dist.get_rank() == 0:
        report(rows)
    dist.barrier()
    dist.destroy_process_group()


def measure(trainer, step: int) -> dict:
    """One batch, both arms; seconds per phase."""
    import torch.distributed as dist

    from gspo_mcore.megatron.parallel import broadcast_from_host
    from gspo_mcore.batch.rollout import Batch

    learner, times, source = trainer.learner, {}, getattr(trainer.host, "source", None)
    began = time.perf_counter()
    rollouts, advantages, _ = broadcast_from_host(source.collect(step, trainer.version) if source else None)
    times["rollout"] = time.perf_counter() - began
    arms = ["engine", "recompute"] if step % 2 == 0 else ["recompute", "engine"]
    for arm in arms:
        old = None
        if arm == "recompute":
            began = time.perf_counter()
            old = learner.recompute_old_logprobs(rollouts)
            times["recompute"] = time.perf_counter() - began
        began = time.perf_counter()
        learner.update(Batch(rollouts, advantages, {}), step, old)
        times[f"update_{arm}"] = time.perf_counter() - began
    began = time.perf_counter()
    trainer.version = f"step-{step + 1}"
    trainer.sync.push(trainer.version)
    times["sync"] = time.perf_counter() - began
    if dist.get_rank() == 0:
        print(json.dumps({"step": step, **{k: round(v, 3) for k, v in times.items()}}), flush=True)
    return times


def report(rows: list[dict]) -> None:
    mean = {key: sum(r[key] for r in rows) / len(rows) for key in rows[0]}
    phases = {
        "engine": {"rollout": mean["rollout"], "recompute": 0.0, "update": mean["update_engine"], "sync": mean["sync"]},
        "recompute": {"rollout": mean["rollout"], "recompute": mean["recompute"], "update": mean["update_recompute"],
                      "sync": mean["sync"]},
    }
    print(f"\nmean over {len(rows)} steps (s, share of the step):")
    print(f"| arm | step | {' | '.join(phases['engine'])} |")
    print("|---|---|" + "---|" * len(phases["engine"]))
    for arm, parts in phases.items():
        total = sum(parts.values())
        cells = " | ".join(f"{v:.3f} ({v / total:.0%})" for v in parts.values())
        print(f"| {arm} | {total:.3f} | {cells} |")
    engine, recompute = (sum(p.values()) for p in phases.values())
    train_engine = phases["engine"]["update"]
    train_recompute = phases["recompute"]["recompute"] + phases["recompute"]["update"]
    print(json.dumps({"step_time_ratio": round(engine / recompute, 4),
                      "train_time_ratio": round(train_engine / train_recompute, 4),
                      "engine_step_s": round(engine, 4), "recompute_step_s": round(recompute, 4),
                      "rollout_s": round(phases["engine"]["rollout"], 4), "engine_train_s": round(train_engine, 4),
                      "recompute_train_s": round(train_recompute, 4),
                      "steps": len(rows)}))


if __name__ == "__main__":
    from gspo_mcore.common.errors import run_cli

    sys.exit(run_cli(lambda: main() or 0))
