"""Deterministic prompt order: a fresh permutation per epoch from (seed, epoch), and a
position that a checkpoint saves, so a resumed run continues with the same prompts."""

from __future__ import annotations

import torch

from gspo_mcore.common.seeds import step_seed


class PromptSampler:
    def __init__(self, num_samples: int, seed: int = 0, shuffle: bool = True):
        if num_samples <= 0:
            raise ValueError("the dataset is empty")
        self.num_samples, self.seed, self.shuffle = num_samples, seed, shuffle
        self.epoch, self.position = 0, 0

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_samples))
        generator = torch.Generator().manual_seed(step_seed(self.seed, epoch))
        return torch.randperm(self.num_samples, generator=generator).tolist()

    def next_indices(self, count: int) -> list[int]:
        """The next `count` prompts, crossing into the next epoch's permutation as needed."""
        indices = []
        while len(indices) < count:
            order = self._order(self.epoch)
            take = order[self.position : self.position + count - len(indices)]
            indices += take
            self.position += len(take)
            if self.position == self.num_samples:
                self.epoch, self.position = self.epoch + 1, 0
        return indices

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict) -> None:
        if (state["seed"], state["num_samples"]) != (self.seed, self.num_samples):
            raise ValueError(
                f"sampler state is for seed {state['seed']} / {state['num_samples']} samples, "
                f"not seed {self.seed} / {self.num_samples}"
            )
        self.epoch, self.position = state["epoch"], state["position"]
