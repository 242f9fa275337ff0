"""What an engine may do beyond the core (`Engine`, gspo_mcore/engines/base.py): each way a push
reaches its servers, the release of a colocated server's memory and the sync check's probe is a
capability, a class the engine also derives from. A run config asks for some of them (`asked`);
`Engine.check_config` refuses, in one line naming the field, a config that asks for one the engine
lacks, before any server starts. The weight sync (gspo_mcore/weight_sync/) calls only the methods
of the capability its method asks for.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from typing import ClassVar

import torch

from gspo_mcore.common.errors import WeightSyncError


def dtype_name(dtype: torch.dtype) -> str:
    """How both engines name a dtype on the wire ("bfloat16")."""
    return str(dtype).removeprefix("torch.")


class UpdateSession(ABC):
    """A push streamed in buckets, inside a weight-update session every server opens and closes
    (the base of the two streamed paths below)."""

    @abstractmethod
    def begin_update(self) -> None:
        """Open the weight-update session on every server."""

    @abstractmethod
    def end_update(self, weight_version: str) -> None:
        """Close it: from now on every server generates with the new weights, tagged `weight_version`."""

    def pack_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
        """The bucket as the one flat byte tensor the engine reads (a colocated push shares it):
        the tensors' bytes, concatenated in order, which both engines read (SGLang's
        "flattened_bucket", vLLM's packed format: packed_tensor.pack_tensors)."""
        return torch.cat([t.contiguous().view(-1).view(torch.uint8) for _, t in bucket])


class ProcessGroupPush(UpdateSession):
    """`weight_sync.method: distributed`: a trainer rank is rank 0 of one process group per server
    (the server's TP workers ranks 1..tp) and broadcasts each packed bucket over it."""

    # The servers take a pushed weight from one trainer rank only (rank 0 of one group per server:
    # vLLM's transfer engine broadcasts from src 0 and keeps one communicator), so the other
    # owners' buckets reach the servers through trainer rank 0 (DistributedWeightSync relays them).
    single_sender: ClassVar[bool] = False

    @abstractmethod
    def open_weight_group(self, url: str, name: str, master_address: str, backend: str, timeout_s: float):
        """A process group of this trainer rank (rank 0) and the server's TP workers; returns it."""

    @abstractmethod
    def close_weight_group(self, url: str, name: str, group) -> None:
        """Leave it on both sides (best effort: also called when the run fails)."""

    @abstractmethod
    def post_bucket(self, url: str, name: str, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """Tell the server to receive `bucket` (its names, dtypes, shapes) over group `name`;
        returns once it answered (raising WeightSyncError for a refusal)."""

    @abstractmethod
    def broadcast(self, group, flat: torch.Tensor) -> None:
        """Rank 0's broadcast of the packed bucket over `group`."""

    def send_bucket(self, groups: list[tuple[str, str, object]], bucket: list[tuple[str, torch.Tensor]],
                    flat: torch.Tensor) -> None:
        """One bucket of (name, tensor) in the engine's dtype, packed as `flat` (`pack_bucket`, its
        data landed), to every server of `groups` ((url, name, group) each). Per server, in a
        fixed order: post it and at once broadcast, so a server only ever waits for a sender
        already broadcasting to it (owners pushing concurrently cannot deadlock, whatever order
        the servers see the posts in)."""
        with ThreadPoolExecutor(max_workers=1) as pool:
            for url, name, group in groups:
                answer = pool.submit(self.post_bucket, url, name, bucket)
                self.broadcast(group, flat)
                self.broadcast_done(url, group, answer)
                answer.result()

    def broadcast_done(self, url: str, group, answer) -> None:
        """Returns once `group`'s broadcast ran, or raises (`answer`: the server's post, in flight).
        Nothing here: a torch.distributed group's watchdog ends a broadcast whose peer is gone."""


class SharedMemoryPush(UpdateSession):
    """`weight_sync.method: tensor` (colocated): each server TP rank maps the copy of each bucket
    held by the trainer rank on its own GPU (CUDA IPC; shared memory on CPU)."""

    @abstractmethod
    def tp_size(self, url: str) -> int:
        """The server's tensor-parallel size (its GPUs, each matched to a trainer rank's)."""

    @abstractmethod
    def prepare_sharing(self, on_gpu: bool) -> None:
        """Before a colocated push: make shared tensors readable by the engine's processes."""

    @abstractmethod
    def shared_payload(self, flat: torch.Tensor, layout: list[tuple[str, tuple[int, ...]]],
                       dtype: torch.dtype) -> object:
        """A handle to `flat` (the packed tensors `layout`) that another process on this host can
        map (picklable: the trainer ranks gather them)."""

    @abstractmethod
    def load_shared(self, url: str, payloads: list) -> None:
        """The server's TP ranks load one payload each (the same host's trainer ranks' copies)."""


class DiskLoad(ABC):
    """`weight_sync.method: disk`, and gspo-eval into running servers: a Hugging Face checkpoint
    on a file system the servers see."""

    @abstractmethod
    def load_from_disk(self, hf_dir, weight_version: str) -> None:
        """Every server loads the checkpoint `hf_dir` and generates with it, tagged `weight_version`."""


class MemoryRelease(ABC):
    """`weight_sync.colocate`: the servers free their GPU memory while the trainer trains."""

    @abstractmethod
    def release_memory(self) -> None:
        """Every server frees its weights and KV cache."""

    @abstractmethod
    def resume_memory(self) -> None:
        """... and takes them back, before the push."""


class SyncProbe(ABC):
    """`weight_sync.check_every`: the sync check's probe of a server's weights."""

    @abstractmethod
    def prefill_logprobs(self, url: str, sequence: list[int]) -> list:
        """The server's log-prob of each token of `sequence` after the first, given the ones before
        it, from one prefill at temperature 1 (None where it gave none)."""

    def prompt_logprobs(self, url: str, sequences: list[list[int]]) -> list[list[float]]:
        """`prefill_logprobs` of each sequence, each checked complete (positions 1..n-1)."""
        out = []
        for seq in sequences:  # one at a time: batching with others may change MoE routing
            values = self.prefill_logprobs(url, seq)
            if len(values) != len(seq) - 1 or any(v is None for v in values):
                raise WeightSyncError(f"server {url}: {len(values)} prompt log-probs ({sum(v is None for v in values)} "
                                      f"missing) for the {len(seq) - 1} tokens after the first of a probe sequence")
            out.append([float(v) for v in values])
        return out


# weight_sync.method -> the capability its push uses.
PUSH = {"distributed": ProcessGroupPush, "tensor": SharedMemoryPush, "disk": DiskLoad}


def asked(config) -> list[tuple[str, type]]:
    """What the run config asks of its engine beyond the core: (the field=value asking, the capability)."""
    ws = config.weight_sync
    wanted = [(f"weight_sync.method={ws.method}", PUSH[ws.method])]
    if ws.colocate:
        wanted.append(("weight_sync.colocate=true", MemoryRelease))
    if ws.check_every:
        wanted.append((f"weight_sync.check_every={ws.check_every}", SyncProbe))
    return wanted


def methods(capability: type) -> str:
    """A capability's methods an engine must implement, for a refusal."""
    return ", ".join(sorted(capability.__abstractmethods__))
