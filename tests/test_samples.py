"""The batch carries its facts: which tokens older weights generated, which responses they routed."""

from gspo_mcore.samples import Batch, Rollout


def rollout(versions, n=None):
    n = len(versions) if n is None else n
    return Rollout([1, 2], list(range(3, 3 + n)), [-0.5] * n, "stop", f"step-{max(versions or [0])}",
                   token_versions=tuple(versions))


def test_a_batch_spanning_versions_marks_each_token_older_than_the_update():
    batch = Batch.spanning([rollout([1, 1, 2]), rollout([2, 2]), rollout([0, 1, 1])], [1.0, -1.0, 0.0], {}, 2,
                           reprefilled=True)
    assert batch.overlapped
    assert batch.stale == [[1.0, 1.0, 0.0], [0.0, 0.0], [1.0, 1.0, 1.0]]


def test_routing_by_older_weights_follows_the_engine():
    """An engine that prefills a continued request again routes all of it with its last token's
    version (SGLang); one that keeps each token's routing routes it with older weights if any token was."""
    rollouts = [rollout([1, 1, 2]), rollout([2, 2]), rollout([1, 1])]
    assert Batch.spanning(rollouts, [0.0] * 3, {}, 2, reprefilled=True).routed_by_older == [False, False, True]
    assert Batch.spanning(rollouts, [0.0] * 3, {}, 2, reprefilled=False).routed_by_older == [True, False, True]


def test_an_untagged_response_counts_as_current():
    batch = Batch.spanning([rollout([], n=3)], [0.0], {}, 5, reprefilled=True)
    assert batch.stale == [[0.0, 0.0, 0.0]] and batch.routed_by_older == [False]


def test_a_synchronous_batch_has_no_stale_marks():
    batch = Batch([rollout([3])], [0.0], {"reward_mean": 1.0})
    assert not batch.overlapped and batch.stale is None and batch.routed_by_older is None
