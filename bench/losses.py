"""Every built-in loss side by side on the long-response task with a bf16 engine
(configs/long_cpu.yaml): GSPO, GSPO-token, GRPO and the GSPO lineage (SAPO, GMPO, LUSPO, CISPO).

    python bench/losses.py --out DIR [--seeds 3] [--arms a,b,...] [key=value ...]

`--smoke`: arms sapo and cispo, one seed, 2 steps of a small batch (the suite's check that the
bench runs). `rollout.urls=[URL]` runs every arm against a running server (started with
--enable-return-routed-experts, as bench/claim.py's runs ask for the routed experts).

Each arm x seed is one real training run made by bench/claim.py's runner (its own SGLang server
unless rollout.urls; a finished run is not run again, so an interrupted grid continues), each loss
with its paper's hyper-parameters (the `loss` defaults; GRPO: the usual 0.2 / 0.28 band) and the
config's defaults otherwise. Writes DIR/losses.md, one table: per arm over the seeds, the reward of
the last 7 of 28 steps (the last quarter) mean +- sd, the clipped share of tokens (SAPO: none;
CISPO: truncated weights) or the masked share (the mismatch corrections), the train-inference
mismatch at theta_old, the response length and the train time per step; the overlaid curves
DIR/reward.png, DIR/clip_fraction.png, DIR/mismatch.png; and prints one JSON line last,
`{"arms": {ARM: {...}}}`. Not a test: runs of one grid share the machine, so compare arms
within one grid.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import claim  # noqa: E402  (the grid runner, its summary and plots: one for both benches)

GRPO = ["loss.function=grpo", "loss.clip_low=0.2", "loss.clip_high=0.28"]
# name -> (what it is, overrides on configs/long_cpu.yaml); the runner reads them from claim.ARMS.
LOSS_ARMS = {
    "gspo": ("GSPO (the default): sequence ratio, clipped per sequence", []),
    "gspo_token": ("GSPO-token: s_i's value with each token's gradient", ["loss.function=gspo_token"]),
    "grpo": ("GRPO: token ratio, clip 0.2 / 0.28", GRPO),
    "sapo": ("SAPO: soft gate, tau 1.0 / 1.05", ["loss.function=sapo"]),
    "gmpo": ("GMPO: geometric mean of token ratios clipped at e^+-0.4", ["loss.function=gmpo"]),
    "luspo": ("LUSPO: GSPO scaled by response length, its clip 2e-3 / 2.5e-3",
              ["loss.function=luspo", "loss.clip_low=2e-3", "loss.clip_high=2.5e-3"]),
    "cispo": ("CISPO: stop-gradient IS weight truncated at 5, token-mean", ["loss.function=cispo"]),
    # Not in the default grid (--arms): the mismatch corrections on GSPO.
    "gspo-tis": ("GSPO + token TIS at 2", ["loss.mismatch_correction=token_tis"]),
    "gspo-mis": ("GSPO + sequence MIS in [1/2, 2]", ["loss.mismatch_correction=sequence_mis"]),
}
DEFAULT_ARMS = list(LOSS_ARMS)[:7]
SMOKE_ARMS = "sapo,cispo"


def summarise(runs: list[list[dict]]) -> dict:
    """claim.summarise's figures and the response length and the corrections' shares."""
    figures = claim.summarise(runs, threshold=float("inf"))
    del figures["steps_to_threshold"]  # no threshold here

    def over_runs(key):
        return claim._mean([claim._mean([r.get(key) for r in rows]) for rows in runs])

    return {**figures, "response_length": over_runs("response_length_mean"),
            "mismatch_kl": over_runs("mismatch_kl"),
            "mismatch_truncated_fraction": over_runs("mismatch_truncated_fraction"),
            "mismatch_masked_fraction": over_runs("mismatch_masked_fraction")}


def write_markdown(path: Path, summary: dict, seeds: list[int], steps: int) -> None:
    fmt = claim._fmt
    lines = [f"# Every built-in loss ({len(seeds)} seeds x {steps} steps, configs/long_cpu.yaml, bf16 engine)", "",
             f"Reward: mean of the last {max(1, steps // 4)} steps, mean +- sd over seeds. Clip: share of response "
             "tokens its clip took (CISPO: weights truncated, gradient kept; SAPO: none). Masked: the mismatch "
             "correction's share (TIS: tokens truncated; MIS: sequences masked). Mismatch: mean |log s_i| of trainer "
             "vs engine at theta = theta_old, and the share of sequences outside GSPO's band there; averaged over "
             "steps and seeds.", "",
             "| loss | reward | clip | masked | mismatch / seq | out of band | response length | train s/step |",
             "|---|---|---|---|---|---|---|---|"]
    for arm, s in summary.items():
        masked = s["mismatch_truncated_fraction"] if s["mismatch_truncated_fraction"] is not None \
            else s["mismatch_masked_fraction"]
        lines.append(f"| {arm} | {s['final_reward_mean']:.3f} +- {s['final_reward_sd']:.3f} | "
                     f"{fmt(s['clip_fraction'], '.3f')} | {fmt(masked, '.1%')} | {fmt(s['mismatch_seq'])} | "
                     f"{fmt(s['out_of_band'], '.0%')} | {fmt(s['response_length'], '.1f')} | "
                     f"{fmt(s['train_s_per_step'], '.2f')} |")
    lines += ["", "Arms:", *[f"- `{arm}`: {what} (`{' '.join(overrides) or 'configs/long_cpu.yaml'}`)"
                             for arm, (what, overrides) in ((a, LOSS_ARMS[a]) for a in summary)], ""]
    path.write_text("\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--arms", default=",".join(DEFAULT_ARMS),
                        help=f"comma-separated, of {', '.join(LOSS_ARMS)} (default: the first seven)")
    parser.add_argument("--smoke", action="store_true", help=f"arms {SMOKE_ARMS}, 1 seed, 2 steps of a small batch")
    parser.add_argument("overrides", nargs="*", help="key=value for every arm (e.g. train.steps=20)")
    args = parser.parse_args()
    if args.smoke:
        args.seeds, args.arms, args.overrides = 1, SMOKE_ARMS, [*claim.SMOKE, *args.overrides]
    arms = args.arms.split(",")
    unknown = [a for a in arms if a not in LOSS_ARMS]
    if unknown:
        raise SystemExit(f"error: --arms: {unknown[0]!r} is not one of {', '.join(LOSS_ARMS)}")
    claim.ARMS.update(LOSS_ARMS)  # claim.run_arm reads an arm's overrides from its table
    os.chdir(claim.REPO)  # the config's paths are relative to the repository
    sys.path.insert(0, str(claim.REPO))
    from gspo_mcore.config import load_config
    from gspo_mcore.tasks.long import make_long_task

    config = load_config(claim.CONFIG, args.overrides)
    make_long_task(Path(config.model.hf_dir).parent)
    args.out.mkdir(parents=True, exist_ok=True)
    seeds = [1234 + i for i in range(args.seeds)]
    for seed in seeds:  # seed-major: an interrupted grid has every arm at the same depth
        for arm in arms:
            claim.run_arm(args.out, arm, seed, args.overrides, config.train.steps)
    runs_by_arm = {arm: [claim.rows_of(args.out / "runs" / arm / f"seed-{seed}") for seed in seeds] for arm in arms}
    summary = {arm: summarise(runs) for arm, runs in runs_by_arm.items()}
    write_markdown(args.out / "losses.md", summary, seeds, config.train.steps)
    claim.plot(args.out, runs_by_arm)
    print((args.out / "losses.md").read_text())
    print(json.dumps({"arms": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
