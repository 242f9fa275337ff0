"""Rollouts from SGLang: parsing and validating its responses, and batching them for training."""
