"""Rewards -> advantages, as pure tensor functions.

GSPO (like GRPO) uses group-normalised advantages: A_i = (r_i - mean(r_group)) / std(r_group)
over the G responses to one prompt (arXiv 2507.18071, eq. 6). Rewards arrive as [N] with
`group_ids` [N] naming each response's prompt group.
"""

from __future__ import annotations


import torch

from gspo_mcore.gspo.choices import REWARD_NORMS, RewardNorm  # noqa: F401 (re-exported)


def _group_stats(values: torch.Tensor, group_ids: torch.Tensor):
    """Per-element mean and (population) std of its group."""
    groups, index, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    values = values.double()
    sums = torch.zeros(len(groups), dtype=torch.float64).index_add_(0, index, values)
    means = sums / counts
    sq = torch.zeros(len(groups), dtype=torch.float64).index_add_(0, index, (values - means[index]) ** 2)
    return means[index], (sq / counts).sqrt()[index]


def group_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6, normalize_std: bool = True
) -> torch.Tensor:
    """(r_i - mean of its group) / (std of its group + eps); float32 [N]."""
    if rewards.shape != group_ids.shape or rewards.dim() != 1:
        raise ValueError(f"rewards {list(rewards.shape)} and group_ids {list(group_ids.shape)} must be the same [N]")
    if not torch.isfinite(rewards).all():
        raise ValueError(f"rewards: non-finite value at index {int((~torch.isfinite(rewards)).nonzero()[0])}")
    mean, std = _group_stats(rewards, group_ids)
    centred = rewards.double() - mean
    return (centred / (std + eps) if normalize_std else centred).float()


def informative_groups(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Mask [N] of responses whose group's rewards are not all equal: a group with identical
    rewards has zero advantages and carries no signal (dynamic sampling drops it)."""
    _, std = _group_stats(rewards, group_ids)
    return std > 0


def all_groups(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Keep every response (no dynamic sampling)."""
    return torch.ones_like(rewards, dtype=torch.bool)


# `rollout.group_filter`: which responses' groups a step keeps; any `module:function(rewards,
# group_ids) -> bool mask [N]` too (a group is kept when any of its responses is).
GROUP_FILTERS = {"informative": informative_groups, "all": all_groups}


def whiten(values: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Zero mean, unit variance."""
    return (values - values.mean()) / (values.std(unbiased=False) + eps)


def clip(values: torch.Tensor, bound: float | None) -> torch.Tensor:
    """Symmetric clip to [-bound, bound] (advantage or reward clipping); None: unchanged."""
    return values if bound is None else values.clamp(-bound, bound)


class RunningMoments:
    """Running mean/std of rewards across steps (Chan et al. parallel update); state is two
    floats and a count, saved with the trainer's checkpoint."""

    def __init__(self):
        self.mean, self.var, self.count = 0.0, 1.0, 0

    def update(self, values: torch.Tensor) -> None:
        values = values.double()
        n, mean, var = values.numel(), values.mean().item(), values.var(unbiased=False).item()
        total = self.count + n
        delta = mean - self.mean
        self.var = (self.var * self.count + var * n + delta**2 * self.count * n / total) / total
        self.mean += delta * n / total
        self.count = total

    def state_dict(self) -> dict:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.mean, self.var, self.count = state["mean"], state["var"], state["count"]


def normalize_rewards(
    rewards: torch.Tensor, group_ids: torch.Tensor, mode: str, running: RunningMoments | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Reward normalisation before advantages: `batch` (whole batch), `group` (per prompt
    group), `running` (moments across steps; updated with this batch first), `none`."""
    if mode == "none":
        return rewards
    if mode == "batch":
        return whiten(rewards.double(), eps=eps).to(rewards.dtype)
    if mode == "group":
        return group_advantages(rewards, group_ids, eps).to(rewards.dtype)
    if mode == "running":
        if running is None:
            raise ValueError("reward_norm 'running' needs a RunningMoments")
        running.update(rewards)
        return ((rewards.double() - running.mean) / (running.var**0.5 + eps)).to(rewards.dtype)
    raise ValueError(f"reward_norm {mode!r} is not one of {REWARD_NORMS}")
