"""Trainer -> inference engine weight transfer: the trainer's weights as Hugging Face tensors
in buckets of bounded size (the push to SGLang builds on this)."""

from __future__ import annotations

from typing import Iterable, Iterator

import torch


def bucketed(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group (name, tensor) pairs, in order, into lists of at most `bucket_bytes` (a tensor
    larger than that travels alone). Streams: one bucket is held at a time."""
    bucket, size = [], 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket
