"""Prompt datasets for rollouts: loading, chat templating, resumable deterministic order."""

from gspo_mcore.data.dataset import PromptDataset, PromptSample, chat_prompt_ids
from gspo_mcore.data.sampler import PromptSampler

__all__ = ["PromptDataset", "PromptSample", "PromptSampler", "chat_prompt_ids"]
