"""Seeds derived from the run's `train.seed`, one rule for every consumer (prompt order per
epoch, minibatch order per step, sampling seeds per step), so a resumed run repeats them."""

from __future__ import annotations


def step_seed(seed: int, index: int) -> int:
    """The seed of step (or epoch) `index` of a run seeded `seed`: distinct for distinct pairs
    while index < 1_000_003."""
    return seed * 1_000_003 + index
