"""Trainer -> inference engine weight transfer.

The trainer's weights leave as Hugging Face tensors (`owned_hf_weights`: TP shards gathered,
global expert ids, every pipeline stage; each tensor on exactly one rank), in buckets of
bounded size, streamed. One interface, `WeightSync` (`push(version)`, `close()`), one class
per path to the engine, chosen by `weight_sync.method` in `build`; each calls only the methods of
the engine capability its path needs (gspo_mcore/engines/capabilities.py, which speak the
engine's own endpoints and layout; a config asking for one the engine lacks was refused at start):
- `DistributedWeightSync` (`ProcessGroupPush`): each rank that owns tensors broadcasts its
  buckets to the servers over its own process group (NCCL on GPUs, gloo on CPU) inside the engine's weight-update session
  (an engine that takes one sender, vLLM: every bucket through rank 0);
- `TensorWeightSync` (colocated, `SharedMemoryPush`): each server TP rank reads every bucket from
  the trainer rank on its own GPU (CUDA IPC);
- `DiskWeightSync` (`DiskLoad`): an HF checkpoint on a shared file system that every server loads.
`check_sync` (`SyncProbe`) proves a push worked: the engine's log-probs of probe sequences against
the trainer's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from gspo_mcore.megatron.qwen3_moe.model import DTYPES
from gspo_mcore.weight_sync.buckets import bucketed, update_session
from gspo_mcore.weight_sync.check import check_sync
from gspo_mcore.weight_sync.disk import DiskWeightSync
from gspo_mcore.weight_sync.distributed import DistributedWeightSync
from gspo_mcore.weight_sync.tensor import TensorWeightSync, colocated_readers, where_ranks_run


class WeightSync(Protocol):
    def push(self, weight_version: str) -> object:
        """Collective: afterwards every server generates with the trainer's weights, tagged `weight_version`."""

    def close(self) -> None:
        """Release what the method holds on both sides (also called when the run fails)."""


def build(config, model, arch, engine, output_dir: Path) -> WeightSync:
    """The config's `weight_sync.method` for this model and these servers. Collective."""
    ws = config.weight_sync
    dtype = DTYPES[config.rollout.engine_dtype]
    if ws.method == "distributed":
        return DistributedWeightSync(model, arch, config.model.spec, engine,
                                     backend="gloo" if config.distributed.device == "cpu" else "nccl",
                                     master_address=ws.master_address, bucket_bytes=ws.bucket_mb << 20, dtype=dtype)
    if ws.method == "tensor":
        return TensorWeightSync(model, arch, config.model.spec, engine, bucket_bytes=ws.bucket_mb << 20, dtype=dtype)
    return DiskWeightSync(model, arch, config.model.spec, engine,
                          disk_dir=Path(ws.disk_dir or Path(output_dir) / "weights_sync"),
                          hf_config_dir=config.model.hf_dir)


__all__ = ["WeightSync", "build", "bucketed", "update_session", "check_sync", "DiskWeightSync",
           "DistributedWeightSync", "TensorWeightSync", "colocated_readers",
           "where_ranks_run"]
