"""What a packed (THD) layout would save over the trainer's padded rows (BSHD), simulated on CPU
with the trainer's own packing (gspo_mcore/gspo/packing.py: minibatches, the data-parallel
balance, first-fit-decreasing microbatches under a padded-token budget, fillers up to the ranks'
largest count) against THD: each rank's sequences first-fit decreasing by real tokens into
microbatches of the same budget (one row, cu_seqlens; no padding but a sequence longer than the
budget alone).

    python bench/packing_sim.py [--steps 20] [--seed 0] [--smoke]

Sequence lengths: lognormal, clipped to [300, 8600] tokens, over a grid of medians and sigmas;
the 30B configs' batch (64 prompts x 8, 4 minibatches, DP 8) at budgets of 16k and 32k. Per
row: padding in the real microbatches and with the fillers, the microbatches BSHD runs against
THD's, and THD's against the ideal (ceil of the rank's real tokens over the budget). Not a test:
the figures depend on the length distribution, which is the point of the grid.
"""

from __future__ import annotations

import argparse
import json
import math
import random

from gspo_mcore.gspo.packing import balance_across_ranks, pack_microbatches, split_minibatches

BATCH, MINIBATCHES, DP = 512, 4, 8
LOW, HIGH = 300, 8600


def lengths_of(rng: random.Random, median: float, sigma: float, count: int) -> list[int]:
    return [min(HIGH, max(LOW, int(rng.lognormvariate(math.log(median), sigma)))) for _ in range(count)]


def thd_microbatches(lengths: list[int], budget: int) -> int:
    """First-fit decreasing by real tokens (a packed row holds sequences back to back)."""
    room: list[int] = []
    for n in sorted(lengths, reverse=True):
        for i, free in enumerate(room):
            if n <= free:
                room[i] -= n
                break
        else:
            room.append(max(0, budget - n))
    return len(room)


def one_step(lengths: list[int], budget: int) -> dict[str, int]:
    """Totals over one step's minibatches: slots, real tokens, microbatches (BSHD with fillers,
    without, THD, ideal)."""
    out = dict.fromkeys(("slots", "filler_slots", "real", "bshd", "bshd_fillers", "thd", "ideal"), 0)
    for mini in split_minibatches(len(lengths), MINIBATCHES):
        shards = balance_across_ranks(mini, lengths, DP)
        packed = [pack_microbatches(shard, lengths, budget) for shard in shards]
        most = max(len(p) for p in packed)
        for shard, microbatches in zip(shards, packed):
            for members in microbatches:
                out["slots"] += len(members) * max(lengths[i] for i in members)
            out["filler_slots"] += (most - len(microbatches)) * max(lengths[i] for i in shard)  # one row each
            out["real"] += sum(lengths[i] for i in shard)
            out["bshd"] += len(microbatches)
            out["bshd_fillers"] += most
            out["thd"] += thd_microbatches([lengths[i] for i in shard], budget)
            out["ideal"] += math.ceil(sum(lengths[i] for i in shard) / budget)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="one step of one distribution at one budget")
    args = parser.parse_args(argv)
    grid = ([(4000, 0.7, 16384)] if args.smoke else
            [(m, s, b) for m in (1600, 2500, 4000) for s in (0.4, 0.7, 1.0) for b in (16384, 32768)])
    steps = 1 if args.smoke else args.steps
    print(f"{BATCH} sequences a step, {MINIBATCHES} minibatches, DP {DP}, lognormal lengths clipped to "
          f"[{LOW}, {HIGH}], {steps} steps (seed {args.seed})")
    print(f"{'median':>6} {'sigma':>5} {'budget':>6} {'mean len':>8} {'padding':>8} {'+fillers':>8} "
          f"{'BSHD/THD mbs':>12} {'+fillers':>8} {'THD/ideal':>9}")
    rows = []
    for median, sigma, budget in grid:
        rng = random.Random(args.seed)
        total = dict.fromkeys(("slots", "filler_slots", "real", "bshd", "bshd_fillers", "thd", "ideal"), 0)
        mean = 0.0
        for _ in range(steps):
            lengths = lengths_of(rng, median, sigma, BATCH)
            mean += sum(lengths) / len(lengths) / steps
            for key, value in one_step(lengths, budget).items():
                total[key] += value
        row = {"median": median, "sigma": sigma, "budget": budget, "mean_length": round(mean),
               "padding": 1 - total["real"] / total["slots"],
               "padding_with_fillers": 1 - total["real"] / (total["slots"] + total["filler_slots"]),
               "bshd_over_thd": total["bshd"] / total["thd"], "bshd_fillers_over_thd": total["bshd_fillers"] / total["thd"],
               "thd_over_ideal": total["thd"] / total["ideal"]}
        rows.append(row)
        print(f"{median:6d} {sigma:5.1f} {budget:6d} {mean:8.0f} {row['padding']:8.1%} "
              f"{row['padding_with_fillers']:8.1%} {row['bshd_over_thd']:12.2f} {row['bshd_fillers_over_thd']:8.2f} "
              f"{row['thd_over_ideal']:9.2f}")
    print(json.dumps({"rows": rows, "padding_range": [min(r["padding"] for r in rows), max(r["padding"] for r in rows)],
                      "bshd_over_thd_range": [min(r["bshd_fillers_over_thd"] for r in rows),
                                              max(r["bshd_fillers_over_thd"] for r in rows)]}))


if __name__ == "__main__":
    main()
