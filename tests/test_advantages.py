import pytest
import torch

from gspo_mcore.gspo.advantages import (
    RunningMoments,
    clip,
    group_advantages,
    informative_groups,
    normalize_rewards,
    whiten,
)


def test_group_normalised_advantages():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.5, 0.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2])
    adv = group_advantages(rewards, groups, eps=0.0 + 1e-12)
    for g in range(3):
        r = rewards[groups == g].double()
        std = r.std(unbiased=False)
        expected = (r - r.mean()) / (std + 1e-12) if std > 0 else torch.zeros_like(r)
        assert torch.allclose(adv[groups == g].double(), expected, atol=1e-6)


def test_identical_rewards_give_zero_advantages_and_are_filtered():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    adv = group_advantages(rewards, groups)
    assert (adv[:3] == 0).all() and torch.isfinite(adv).all()
    assert informative_groups(rewards, groups).tolist() == [False, False, False, True, True, True]


def test_errors():
    with pytest.raises(ValueError, match="must be the same"):
        group_advantages(torch.zeros(3), torch.zeros(4))
    with pytest.raises(ValueError, match="non-finite value at index 1"):
        group_advantages(torch.tensor([0.0, float("nan")]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="reward_norm 'zscore'"):
        normalize_rewards(torch.zeros(2), torch.zeros(2), "zscore")


def test_whiten_and_clip():
    x = torch.tensor([1.0, 2.0, 3.0, 100.0])
    w = whiten(x)
    assert abs(w.mean().item()) < 1e-6 and abs(w.std(unbiased=False).item() - 1) < 1e-6
    assert clip(torch.tensor([-5.0, 0.5, 5.0]), 2.0).tolist() == [-2.0, 0.5, 2.0]
    assert clip(x, None) is x


def test_group_reward_norm_is_reachable_from_the_config():
    """reward_norm 'group' (per prompt group) is a config choice, and normalises per group."""
    from gspo_mcore.config import load_config

    assert load_config(None, ["reward.norm=group"]).reward.norm == "group"
    rewards = torch.tensor([1.0, 3.0, 10.0, 30.0])
    normed = normalize_rewards(rewards, torch.tensor([0, 0, 1, 1]), "group")
    assert torch.allclose(normed, torch.tensor([-1.0, 1.0, -1.0, 1.0]), atol=1e-5)


def test_running_moments_match_the_concatenation():
    running = RunningMoments()
    chunks = [torch.randn(7) * 3 + 1, torch.randn(5) - 2, torch.randn(11)]
    for c in chunks:
        running.update(c)
    everything = torch.cat(chunks).double()
    assert abs(running.mean - everything.mean().item()) < 1e-9
    assert abs(running.var - everything.var(unbiased=False).item()) < 1e-9
    restored = RunningMoments()
    restored.load_state_dict(running.state_dict())
    assert restored.state_dict() == running.state_dict()


@pytest.mark.parametrize("mode", ["batch", "group", "running", "none"])
def test_normalize_rewards_modes(mode):
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5])
    groups = torch.tensor([0, 0, 1, 1])
    out = normalize_rewards(rewards, groups, mode, running=RunningMoments())
    assert out.shape == rewards.shape and torch.isfinite(out).all()
    if mode == "none":
        assert out is rewards
    if mode == "group":
        assert out[2:].abs().max() == 0
