"""What the trainer, the producer, the evaluator, the weight sync and the planner ask of an
inference engine: one interface, `Engine`, one package per engine (gspo_mcore/engines/<name>/).

An `Engine` speaks to every server of one run (their URLs, their API key). Generation goes through
the client it makes (`client()`: token ids in; a `Rollout` out: tokens, per-token log-probs of the
distribution sampled, per-token weight versions, routed experts, finish reason). Class-level
methods answer before any server runs: the launch command a config describes, and the memory the
planner counts. Every failure of a control call is a `WeightSyncError` naming the server and what
was asked: a half-applied update must stop the run, never let it train on rollouts of unknown
weights.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import ClassVar

import torch

from gspo_mcore.errors import InputError, WeightSyncError


def check_answer(url: str, path: str, answer: object, accepted, expected: str) -> None:
    """A control call's answer that is a precondition of exactness (a pause, a version set, a
    cache flush): one that `accepted` refuses is an error naming the server, the route, what was
    expected and what it said (a refusal answered with HTTP 200 must not pass silently)."""
    if not accepted(answer):
        raise WeightSyncError(f"server {url}{path}: {expected}, answered {str(answer)[:300]!r}")


def check_sampling_params(params: dict) -> None:
    """The engine's log-probs are of softmax(logits / temperature) before any truncation; with
    top-p / top-k / min-p the sampled distribution differs and the ratio would be wrong."""
    if params.get("top_p", 1.0) < 1.0 or params.get("top_k", -1) not in (-1, 0) or params.get("min_p", 0.0) > 0:
        raise InputError(
            "sampling: top_p / top_k / min_p are not supported (the importance ratio needs the "
            "log-probs of the distribution actually sampled); use temperature only"
        )
    if params.get("temperature", 1.0) <= 0:
        raise InputError("sampling: temperature must be > 0 (greedy decoding has no log-probs to train on)")


@dataclass(frozen=True)
class EngineMemory:
    """Per engine GPU, for the planner: the weights, the KV cache per token, and what the engine
    holds besides (CUDA graphs, activations, its own allocator's slack)."""
    weights_gb: float
    kv_bytes_per_token: int
    margin_gb: float
    usable_fraction: float  # of a GPU the engine gives to weights and KV cache when it has the GPU alone


class Engine(ABC):
    """Every server of one inference engine a run uses (see the module docstring)."""

    name: ClassVar[str]
    # What a request continued after a pause that kept its tokens is routed by: True when the
    # engine prefills the whole sequence again under the new weights (so all of a response's
    # routed experts are its last token's version's), False when each token keeps its own.
    reprefills_continued_requests: ClassVar[bool]
    # The servers take a pushed weight from one trainer rank only (rank 0 of one group per server:
    # vLLM's transfer engine broadcasts from src 0 and keeps one communicator), so the other
    # owners' buckets reach the servers through trainer rank 0 (DistributedWeightSync relays them).
    single_sender: ClassVar[bool] = False

    def __init__(self, urls: list[str], timeout_s: float = 600.0, api_key: str | None = None):
        if not urls:
            raise InputError("rollout: no server URLs")
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout_s, self.api_key = timeout_s, api_key

    # ---------------------------------------------------------------- control calls
    # Each engine's `call(url, path, body)` posts one control request and returns its answer
    # (raising WeightSyncError for a failed request).
    def on_all(self, path: str, body: dict | None = None) -> list:
        """The same call on every server at once (a weight-update step must reach all of them)."""
        with ThreadPoolExecutor(max_workers=len(self.urls)) as pool:
            return list(pool.map(lambda url: self.call(url, path, body), self.urls))

    def on_all_checked(self, path: str, body: dict | None, accepted, expected: str) -> None:
        """`on_all`, each server's answer checked (`check_answer`)."""
        for url, answer in zip(self.urls, self.on_all(path, body)):
            check_answer(url, path, answer, accepted, expected)

    # ---------------------------------------------------------------- before any server runs
    @classmethod
    @abstractmethod
    def launch_command(cls, config, port: int, host: str = "127.0.0.1",
                       api_key: str | None = None) -> tuple[list[str], dict]:
        """The server command line and environment the run config describes."""

    @classmethod
    @abstractmethod
    def memory(cls, arch, engine_tp: int, total_params: int) -> EngineMemory:
        """What one engine GPU holds for this model of `total_params` parameters (the planner's figures)."""

    @classmethod
    def push_buffer_bytes(cls, method: str, bucket_bytes: int, senders: int) -> int:
        """What one engine GPU holds for a push beside its weights and KV cache (receive buffers),
        at `weight_sync.method`, buckets of `bucket_bytes`, from `senders` owning trainer ranks
        interleaved round by round (weight_sync.buckets.owned_rounds). Counted by the planner."""
        return 0

    @classmethod
    def check_config(cls, config) -> None:
        """A ConfigError naming the field for what the run config asks and this engine cannot do."""

    # ---------------------------------------------------------------- the servers
    @abstractmethod
    def healthy(self, url: str) -> bool:
        """The server answers and can generate."""

    @abstractmethod
    def capacity(self, url: str, default: int, request_tokens: int = 0) -> int:
        """How many requests of `request_tokens` (prompt + response) the server runs at once, with
        room for each in its KV cache (`default` when it does not say)."""

    @abstractmethod
    def tp_size(self, url: str) -> int:
        """The server's tensor-parallel size (its GPUs, each a member of a weight group)."""

    # ---------------------------------------------------------------- generation
    @abstractmethod
    def client(self, vocab_size: int, *, request_timeout_s: float = 600.0, max_attempts: int = 5,
               max_concurrency: int = 64, routing_shape: tuple[int, int] | None = None):
        """The generation client for these servers (`generate`, `generate_one`, `generate_one_async`, `close`)."""

    @abstractmethod
    def prompt_logprobs(self, url: str, sequences: list[list[int]]) -> list[list[float]]:
        """The log-prob of each token of each sequence given the ones before it (positions
        1..n-1), from one prefill each: the weight sync check's probe."""

    @abstractmethod
    def pause(self, keep_tokens: bool = True) -> None:
        """Every server stops generating before a push (asynchronous modes). `keep_tokens`: the
        running requests keep their tokens and continue after `resume`; else they are aborted."""

    @abstractmethod
    def resume(self) -> None:
        """After a push: paused requests continue under the new weights."""

    # ---------------------------------------------------------------- colocated memory
    @abstractmethod
    def release_memory(self) -> None:
        """Colocated runs: the engine frees its weights and KV cache while the trainer trains."""

    @abstractmethod
    def resume_memory(self) -> None:
        """... and takes them back before the push."""

    # ---------------------------------------------------------------- weight updates
    @abstractmethod
    def begin_update(self) -> None:
        """Open the weight-update session on every server."""

    @abstractmethod
    def end_update(self, weight_version: str) -> None:
        """Close it: from now on every server generates with the new weights, tagged `weight_version`."""

    @abstractmethod
    def load_from_disk(self, hf_dir, weight_version: str) -> None:
        """Every server loads the Hugging Face checkpoint `hf_dir` (a file system both see)."""

    @abstractmethod
    def open_weight_group(self, url: str, name: str, master_address: str, backend: str, timeout_s: float):
        """A process group of this trainer rank (rank 0) and the server's TP workers; returns it."""

    @abstractmethod
    def close_weight_group(self, url: str, name: str, group) -> None:
        """Leave it on both sides (best effort)."""

    @abstractmethod
    def send_bucket(self, groups: list[tuple[str, str, object]], bucket: list[tuple[str, torch.Tensor]],
                    flat: torch.Tensor) -> None:
        """One bucket of (name, tensor) in the engine's dtype, packed as `flat` (`pack_bucket`, its
        data landed), to every server of `groups` ((url, name, group) each), over the groups."""

    def pack_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
        """The bucket as the one flat byte tensor the engine reads (a colocated push shares it):
        the tensors' bytes, concatenated in order, which both engines read (SGLang's
        "flattened_bucket", vLLM's packed format: packed_tensor.pack_tensors)."""
        return torch.cat([t.contiguous().view(-1).view(torch.uint8) for _, t in bucket])

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
