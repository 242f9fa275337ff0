"""Seeds derived from the run's `train.seed`, one rule for every consumer (prompt order per
epoch, minibatch order per step, each request's sampling seed), so a resumed run repeats them."""

from __future__ import annotations

import hashlib

# Sampling seeds are kept below 2**32: torch's CPU generators read a seed's low 32 bits only
# (at::mt19937, seeded through init_with_uint32), and vLLM's per-request generators and the
# CPU SGLang server's seeded sampler are such generators; seeds differing above would draw alike.
SEED_RANGE = 2 ** 32


def step_seed(seed: int, index: int) -> int:
    """The seed of step (or epoch) `index` of a run seeded `seed`: distinct for distinct pairs
    while index < 1_000_003."""
    return seed * 1_000_003 + index


def request_seed(seed: int, *key: int | str | None) -> int:
    """The sampling seed, in [0, 2**32), of the request `key` names in a run seeded `seed`: a
    hash, so that keys that differ anywhere draw unrelated numbers (two collide with chance
    2**-32) and no arithmetic on one key reaches another's seed."""
    digest = hashlib.blake2b(repr((seed, *key)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % SEED_RANGE


def rollout_seed(seed: int, draw: int, sample: int) -> int:
    """Training sample `sample` (its index in the group) of the prompt drawn `draw`-th in the run
    (the sampler's position counted over epochs: epoch x dataset size + position). The draw
    stands for the step and the prompt's place in it: it is what a synchronous run, an
    asynchronous one (whose group does not know its step when it is admitted) and a resumed one
    (which draws again from the checkpoint's position) share for the same sample."""
    return request_seed(seed, "rollout", draw, sample)


def eval_seed(seed: int, dataset: str, version: str | None, prompt: int, sample: int) -> int:
    """Evaluation sample `sample` of prompt `prompt` of eval dataset `dataset`, evaluated on the
    weights `version` ("step-N": the step, or None outside a run)."""
    return request_seed(seed, "eval", dataset, version, prompt, sample)


def turn_seed(seed: int, turn: int) -> int:
    """Turn `turn` (from 0) of a trajectory seeded `seed`: each turn its own numbers (vLLM's
    generator seeded alike for two turns would give them the same draws)."""
    return seed if turn == 0 else request_seed(seed, "turn", turn)
