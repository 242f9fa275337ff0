"""The batch carries its facts: which tokens older weights generated, which responses they routed."""

from gspo_mcore.batch.rollout import Batch, Rollout


def rollout(versions, n=None):
    n = len(versions) if n is None else n
    return Rollout([1, 2], list(range(3, 3 + n)), [-0.5] * n, "stop", f"step-{max(versions or [0])}",
                   token_versions=tuple(versions))


def test_a_batch_spanning_versions_marks_each_token_older_than_the_update():
    batch = Batch.spanning([rollout([1, 1, 2]), rollout([2, 2]), rollout([0, 1, 1])], [1.0, -1.0, 0.0], {}, 2)
    assert batch.overlapped
    assert batch.stale == [[1.0, 1.0, 0.0], [0.0, 0.0], [1.0, 1.0, 1.0]]


def test_routing_by_older_weights_is_the_last_tokens():
    """The engines prefill a continued request again: all of it is routed by its last token's
    version's weights, whatever older versions generated its earlier tokens."""
    rollouts = [rollout([1, 1, 2]), rollout([2, 2]), rollout([1, 1])]
    assert Batch.spanning(rollouts, [0.0] * 3, {}, 2).routed_by_older == [False, False, True]


def test_an_untagged_response_counts_as_current():
    batch = Batch.spanning([rollout([], n=3)], [0.0], {}, 5)
    assert batch.stale == [[0.0, 0.0, 0.0]] and batch.routed_by_older == [False]


def test_a_synchronous_batch_has_no_stale_marks():
    batch = Batch([rollout([3])], [0.0], {"reward_mean": 1.0})
    assert not batch.overlapped and batch.stale is None and batch.routed_by_older is None
