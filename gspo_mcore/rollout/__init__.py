"""Prompts into training batches: the producer (sync, one-step-off, async), the rollout source
(generation rounds, rewards, advantages, dynamic sampling), rollout functions and the tool loop."""
