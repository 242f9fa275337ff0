"""The mission's claim, measured: GSPO on the engine's log-probs with a free router, against
recomputation, routing replay, mismatch masks and GRPO, on a long-response task with a bf16
engine (configs/long_cpu.yaml).

    python bench/claim.py --out DIR [--seeds 3] [--arms a,b,...] [--threshold 0.35] [key=value ...]

`--smoke`: arms gspo-engine and gspo-recompute, one seed, 2 steps of a small batch (the suite's
check that the bench runs). `rollout.urls=[URL]` runs every arm against a running server (started
with --enable-return-routed-experts) instead of its own.

Each arm x seed is one real training run (`python -m gspo_mcore.train`, its own SGLang server)
under DIR/runs/ARM/seed-S; a finished run is not run again, so an interrupted grid continues.
Every arm asks the engine for its routed experts (capture only; it changes no numerics), so
routing mismatch is measured everywhere. Writes DIR/claim.md (per arm, over the seeds: final
reward mean +- sd, steps to the reward threshold, train-inference mismatch per sequence and per
token, out-of-band fraction, routing mismatch, clip fraction, train time per step), overlaid
plots DIR/reward.png, DIR/clip_fraction.png, DIR/mismatch.png, and prints one JSON line last:
`{"arms": {ARM: {...}}}`. Not a test: runs of one grid share the machine, so compare arms
within one grid.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "long_cpu.yaml"
WIDE_BAND = ["loss.clip_low=0.003", "loss.clip_high=0.004"]  # 10x the paper's band
# The paper's setup, the default before this grid: the configured band everywhere, pi_old the
# engine's (or recomputed) from the first minibatch on.
PAPER = ["loss.on_policy_first_minibatch=false", "loss.band_from_mismatch=null"]
GRPO = ["loss.function=grpo", "loss.clip_low=0.2", "loss.clip_high=0.28"]
RECOMPUTE = ["train.recompute_old_logprobs=true"]

# name -> (what it is, config overrides on top of configs/long_cpu.yaml). `gspo-engine` is the
# config's default; the other engine arms pin the paper's setup, so each differs from the default
# before this grid (`gspo-engine-paper`) in one thing.
ARMS = {
    "gspo-engine": ("GSPO, engine log-probs, free router: the default (first minibatch on-policy, later "
                    "minibatches' band >= 2x the mismatch measured on the first)", []),
    "gspo-recompute": ("GSPO, pi_old recomputed by the trainer, the same band rule", RECOMPUTE),
    "gspo-engine-paper": ("GSPO, engine log-probs, the paper's band from the first minibatch on (the default "
                          "before)", PAPER),
    "gspo-recompute-paper": ("GSPO, recomputed, the paper's band", [*PAPER, *RECOMPUTE]),
    "grpo-engine": ("GRPO, engine log-probs", [*PAPER, *GRPO]),
    "grpo-recompute": ("GRPO, recomputed", [*PAPER, *GRPO, *RECOMPUTE]),
    "gspo-engine-replay": ("GSPO, engine log-probs, engine routing replayed (R3), paper band",
                           [*PAPER, "train.routing_replay=true"]),
    "gspo-engine-tokenmask": ("GSPO, engine log-probs, IcePop token mask [0.5, 2], paper band",
                              [*PAPER, "loss.token_mask_band=[0.5,2.0]"]),
    "gspo-engine-seqmask": ("GSPO, engine log-probs, DeepSeek-V3.2 sequence mask (delta 1e-4), paper band",
                            [*PAPER, "loss.sequence_mask_threshold=0.0001"]),
    # Not in the default grid (--arms): a wider band alone, and on-policy-first alone.
    "gspo-engine-wide": ("GSPO, engine log-probs, 10x band", [*PAPER, *WIDE_BAND]),
    "gspo-recompute-wide": ("GSPO, recomputed, 10x band", [*PAPER, *WIDE_BAND, *RECOMPUTE]),
    "gspo-engine-onpolicy1": ("GSPO, engine log-probs, first minibatch on-policy, paper band later",
                              ["loss.band_from_mismatch=null"]),
    # Asynchronous GSPO (decoupled, max_staleness 1) against the default's synchronous loop.
    "gspo-async": ("GSPO, asynchronous (rollout.mode async, max_staleness 1, decoupled loss)", ["rollout.mode=async"]),
}
DEFAULT_ARMS = list(ARMS)[:9]
SMOKE = ["train.steps=2", "train.rollout_batch_size=2", "train.group_size=4", "rollout.max_new_tokens=16"]


def run_arm(out: Path, arm: str, seed: int, extra: list[str], steps: int) -> Path:
    run_dir = out / "runs" / arm / f"seed-{seed}"
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and len(metrics.read_text().splitlines()) >= steps:
        return run_dir
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    overrides = [*ARMS[arm][1], f"train.seed={seed}", "rollout.return_routed_experts=true", "train.export_hf=false",
                 "eval.datasets=[]", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO)}
    began = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "gspo_mcore.train", "--config", str(CONFIG), "--output-dir",
                           str(run_dir), *overrides], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"error: {arm} seed {seed} failed:\n{proc.stderr[-3000:]}")
    print(f"{arm} seed {seed}: {time.monotonic() - began:.0f} s", flush=True)
    return run_dir


def rows_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def steps_to(rows: list[dict], threshold: float, window: int = 3) -> int | None:
    """First step at which the mean reward of the last `window` steps reaches `threshold`."""
    rewards = [r["reward_mean"] for r in rows]
    for end in range(window, len(rewards) + 1):
        if sum(rewards[end - window:end]) / window >= threshold:
            return rows[end - 1]["step"]
    return None


def summarise(runs: list[list[dict]], threshold: float) -> dict:
    """One arm over its seeds. Final reward: the mean of each run's last quarter of steps."""
    tail = max(1, len(runs[0]) // 4)
    finals = [sum(r["reward_mean"] for r in rows[-tail:]) / tail for rows in runs]

    def over_runs(key):
        return _mean([_mean([r.get(key) for r in rows]) for rows in runs])

    return {
        "final_reward_mean": statistics.mean(finals),
        "final_reward_sd": statistics.stdev(finals) if len(finals) > 1 else 0.0,
        "final_reward_per_seed": finals,
        "steps_to_threshold": [steps_to(rows, threshold) for rows in runs],
        "mismatch_seq": over_runs("mismatch_abs_log_ratio_mean"),
        "mismatch_token": over_runs("mismatch_token_abs_log_ratio_mean"),
        "out_of_band": over_runs("mismatch_out_of_band_fraction"),
        "routing_mismatch": over_runs("routing_mismatch_fraction"),
        "clip_fraction": over_runs("clip_fraction"),
        "train_s_per_step": over_runs("time_train_s"),
        "token_mask_fraction": over_runs("token_mask_fraction"),
        "sequence_mask_fraction": over_runs("sequence_mask_fraction"),
        "clip_band_high": over_runs("clip_band_high"),
    }


def _fmt(value, spec=".3g") -> str:
    return "-" if value is None else format(value, spec)


def write_markdown(path: Path, summary: dict, threshold: float, seeds: list[int], steps: int) -> None:
    lines = [f"# GSPO on engine log-probs: the grid ({len(seeds)} seeds x {steps} steps, configs/long_cpu.yaml, "
             "bf16 engine)", "",
             f"Final reward: mean of the last quarter of steps, mean +- sd over seeds. Steps to {threshold}: first step "
             "where the 3-step mean reward reaches it (- : never). Mismatch figures are on the first minibatch of "
             "each step (theta = theta_old), averaged over steps and seeds.", "",
             "| arm | final reward | steps to threshold | mismatch / seq | mismatch / token | out of band | "
             "routing mismatch | clip fraction | train s/step | masked |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for arm, s in summary.items():
        masked = s["token_mask_fraction"] if s["token_mask_fraction"] is not None else s["sequence_mask_fraction"]
        lines.append(
            f"| {arm} | {s['final_reward_mean']:.3f} +- {s['final_reward_sd']:.3f} | "
            f"{', '.join('-' if v is None else str(v) for v in s['steps_to_threshold'])} | {_fmt(s['mismatch_seq'])} | "
            f"{_fmt(s['mismatch_token'])} | {_fmt(s['out_of_band'], '.0%')} | {_fmt(s['routing_mismatch'], '.2%')} | "
            f"{_fmt(s['clip_fraction'], '.3f')} | {_fmt(s['train_s_per_step'], '.2f')} | {_fmt(masked, '.1%')} |")
    lines += ["", "Arms:", *[f"- `{arm}`: {ARMS[arm][0]} (`{' '.join(ARMS[arm][1]) or 'configs/long_cpu.yaml'}`)"
                             for arm in summary], ""]
    path.write_text("\n".join(lines))


def plot(out: Path, runs_by_arm: dict[str, list[list[dict]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for name, key, title in (("reward", "reward_mean", "mean reward"),
                             ("clip_fraction", "clip_fraction", "clipped share of response tokens"),
                             ("mismatch", "mismatch_abs_log_ratio_mean", "|log s_i| at theta_old (engine vs trainer)")):
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for arm, runs in runs_by_arm.items():
            steps = [r["step"] for r in runs[0]]
            values = [_mean([rows[i].get(key) for rows in runs if i < len(rows)]) for i in range(len(steps))]
            points = [(s, v) for s, v in zip(steps, values) if v is not None]
            if points:
                ax.plot(*zip(*points), label=arm)
        ax.set_xlabel("step")
        ax.set_ylabel(title)
        ax.set_title(f"{title} (mean over seeds)")
        if key == "mismatch_abs_log_ratio_mean":
            ax.set_yscale("log")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=110)
        plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--arms", default=",".join(DEFAULT_ARMS),
                        help=f"comma-separated, of {', '.join(ARMS)} (default: the first nine)")
    parser.add_argument("--threshold", type=float, default=0.35, help="reward for 'steps to threshold'")
    parser.add_argument("--smoke", action="store_true", help="2 arms, 1 seed, 2 steps of a small batch")
    parser.add_argument("overrides", nargs="*", help="key=value for every arm (e.g. train.steps=20)")
    args = parser.parse_args()
    if args.smoke:
        args.seeds, args.arms, args.overrides = 1, "gspo-engine,gspo-recompute", [*SMOKE, *args.overrides]
    arms = args.arms.split(",")
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise SystemExit(f"error: --arms: {unknown[0]!r} is not one of {', '.join(ARMS)}")
    os.chdir(REPO)  # the config's paths are relative to the repository
    sys.path.insert(0, str(REPO))
    from gspo_mcore.config import load_config
    from gspo_mcore.tasks.long import make_long_task

    config = load_config(CONFIG, args.overrides)
    make_long_task(Path(config.model.hf_dir).parent)
    args.out.mkdir(parents=True, exist_ok=True)
    seeds = [1234 + i for i in range(args.seeds)]
    runs_by_arm = {}
    for seed in seeds:  # seed-major: an interrupted grid has every arm at the same depth
        for arm in arms:
            run_arm(args.out, arm, seed, args.overrides, config.train.steps)
    for arm in arms:
        runs_by_arm[arm] = [rows_of(args.out / "runs" / arm / f"seed-{seed}") for seed in seeds]
    summary = {arm: summarise(runs, args.threshold) for arm, runs in runs_by_arm.items()}
    write_markdown(args.out / "claim.md", summary, args.threshold, seeds, config.train.steps)
    plot(args.out, runs_by_arm)
    print((args.out / "claim.md").read_text())
    print(json.dumps({"arms": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
