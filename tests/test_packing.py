import random

import pytest

from gspo_mcore.gspo.packing import balance_across_ranks, pack_microbatches, split_minibatches


def test_split_minibatches_covers_in_order_with_near_equal_sizes():
    parts = split_minibatches(10, 4)
    assert [len(p) for p in parts] == [3, 3, 2, 2]
    assert [i for p in parts for i in p] == list(range(10))


@pytest.mark.parametrize("seed", range(5))
def test_balance_gives_every_sequence_once_and_near_equal_tokens(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 500) for _ in range(37)]
    indices = list(range(0, 37, 1))
    shards = balance_across_ranks(indices, lengths, 4)
    assert sorted(i for s in shards for i in s) == indices
    tokens = [sum(lengths[i] for i in s) for s in shards]
    # Longest-first greedy: the spread is at most one sequence's length.
    assert max(tokens) - min(tokens) <= max(lengths)
    assert all(shards)


def test_balance_refuses_fewer_sequences_than_ranks():
    with pytest.raises(ValueError, match="2 sequences cannot feed 4 data-parallel ranks"):
        balance_across_ranks([0, 1], [5, 5], 4)


@pytest.mark.parametrize("seed", range(5))
def test_microbatches_respect_the_padded_token_budget_and_keep_sequences_whole(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 300) for _ in range(50)] + [900]  # one longer than the budget
    indices = list(range(51))
    microbatches = pack_microbatches(indices, lengths, max_tokens=512)
    assert sorted(i for m in microbatches for i in m) == indices
    for m in microbatches:
        padded = len(m) * max(lengths[i] for i in m)
        assert padded <= 512 or m == [50]
    # First-fit decreasing is not wasteful: within 2x of the unpadded lower bound.
    assert len(microbatches) <= 2 * sum(lengths) / 512 + 2


def test_masked_in_values_spread_over_the_response_with_zeros_for_the_environment():
    """A trainer forward yields the trained tokens' log-probs only; pi_prox, a recomputed pi_old
    and the reference need one per response token (a multi-turn trajectory's environment: 0)."""
    from gspo_mcore.gspo.packing import spread_over_response

    assert spread_over_response([-1.0, -2.0, -3.0], [1, 0, 0, 1, 1]) == [-1.0, 0.0, 0.0, -2.0, -3.0]
    assert spread_over_response([-1.0], [1]) == [-1.0]
    with pytest.raises(ValueError, match="2 values for 1 masked-in tokens"):
        spread_over_response([-1.0, -2.0], [0, 1])
