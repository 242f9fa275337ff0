"""Sequences -> minibatches -> data-parallel shards -> microbatches, as pure functions.

Every sequence stays whole inside one microbatch. A microbatch costs its padded size
(sequences x longest length), which `max_tokens` bounds; a sequence longer than the budget
travels alone.
"""

from __future__ import annotations


def split_minibatches(num_samples: int, num_minibatches: int) -> list[list[int]]:
    """Consecutive, near-equal slices of the (already shuffled) sample order."""
    base, extra = divmod(num_samples, num_minibatches)
    out, start = [], 0
    for i in range(num_minibatches):
        size = base + (i < extra)
        out.append(list(range(start, start + size)))
        start += size
    return out


def balance_across_ranks(indices: list[int], lengths: list[int], num_ranks: int) -> list[list[int]]:
    """Longest first to the rank with the fewest tokens (ties: fewest sequences), so DP ranks
    get near-equal work; every rank gets at least one sequence when there are enough."""
    if len(indices) < num_ranks:
        raise ValueError(f"{len(indices)} sequences cannot feed {num_ranks} data-parallel ranks")
    shards: list[list[int]] = [[] for _ in range(num_ranks)]
    tokens = [0] * num_ranks
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        rank = min(range(num_ranks), key=lambda r: (tokens[r], len(shards[r]), r))
        shards[rank].append(i)
        tokens[rank] += lengths[i]
    return [sorted(s) for s in shards]


def pack_microbatches(indices: list[int], lengths: list[int], max_tokens: int) -> list[list[int]]:
    """First-fit decreasing by length into microbatches whose padded size
    (count x longest) stays within `max_tokens`."""
    microbatches: list[list[int]] = []
    longest: list[int] = []
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        for m, members in enumerate(microbatches):
            # Sorted decreasing: the first member is the longest, so adding i keeps it.
            if (len(members) + 1) * longest[m] <= max_tokens:
                members.append(i)
                break
        else:
            microbatches.append([i])
            longest.append(lengths[i])
    return microbatches
