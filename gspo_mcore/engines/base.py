"""What the trainer, the producer, the evaluator and the planner ask of every inference engine: one
small interface, `Engine`, one package per engine (gspo_mcore/engines/<name>/).

The core, which every engine implements: its launch command and memory model (class methods,
answered before any server runs), the generation client (`client_class`: token ids in; a
`Rollout` out: tokens, per-token log-probs of the distribution sampled, per-token weight versions,
routed experts, finish reason; the abort of everything in flight), pause and resume around a push,
health and capacity. Each weight-transfer path, the release of a colocated server's memory and the
sync check's probe are optional capabilities (gspo_mcore/engines/capabilities.py), refused by
`check_config` in one line when a config asks for one the engine lacks.

An `Engine` speaks to every server of one run (their URLs, their API key). Every failure of a
control call is a `WeightSyncError` naming the server and what was asked: a half-applied update
must stop the run, never let it train on rollouts of unknown weights.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, ClassVar

from gspo_mcore.config import ConfigError
from gspo_mcore.engines.capabilities import asked, methods
from gspo_mcore.common.errors import InputError, WeightSyncError
from gspo_mcore.common.http import HTTPRequestError, request_json

GB = 2**30


def server_urls(urls: list[str]) -> list[str]:
    """The servers' base URLs (no trailing slash); none is an error."""
    if not urls:
        raise InputError("rollout: no server URLs")
    return [u.rstrip("/") for u in urls]


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


def kv_bytes_per_token(arch, engine_tp: int, dtype_bytes: int = 2) -> int:
    """K and V of every layer for one token on each of a server's `engine_tp` GPUs: the KV heads
    split over TP, each GPU keeping at least one."""
    return 2 * arch.num_layers * max(1, arch.num_key_value_heads // engine_tp) * arch.head_dim * dtype_bytes


@dataclass(frozen=True)
class EngineMemory:
    """Per engine GPU, for the planner: the weights, the KV cache per token, and what the engine
    holds besides (CUDA graphs, activations, its own allocator's slack)."""
    weights_gb: float
    kv_bytes_per_token: int
    margin_gb: float
    usable_fraction: float  # of a GPU the engine gives to weights and KV cache when it has the GPU alone

    @classmethod
    def bf16_over_tp(cls, arch, engine_tp: int, total_params: int, *, margin_gb: float,
                     usable_fraction: float) -> "EngineMemory":
        """bf16 weights and KV cache, both split over the server's TP ranks."""
        return cls(weights_gb=total_params * 2 / engine_tp / GB, kv_bytes_per_token=kv_bytes_per_token(arch, engine_tp),
                   margin_gb=margin_gb, usable_fraction=usable_fraction)


class Engine(ABC):
    """Every server of one inference engine a run uses (see the module docstring).

    `pause(keep_tokens=True)` / `resume` must prefill a continued request again under the new
    weights: the trainer takes every routed expert of a response continued after a push as its
    last token's version's."""

    name: ClassVar[str]

    def __init__(self, urls: list[str], timeout_s: float = 600.0, api_key: str | None = None):
        self.urls = server_urls(urls)
        self.timeout_s, self.api_key = timeout_s, api_key

    # ---------------------------------------------------------------- before any server runs
    @classmethod
    @abstractmethod
    def launch_command(cls, config, port: int, host: str = "127.0.0.1",
                       api_key: str | None = None) -> tuple[list[str], dict]:
        """The server command line and environment the run config describes."""

    # The memory model's two figures of an engine: what a GPU holds beside the weights and the KV
    # cache (CUDA graphs, activations, buffers), and the share of the GPU it lets them use.
    MARGIN_GB: ClassVar[float]
    USABLE_FRACTION: ClassVar[float]

    @classmethod
    def memory(cls, arch, engine_tp: int, total_params: int) -> EngineMemory:
        """What one engine GPU holds for this model of `total_params` parameters (the planner's
        figures): bf16 weights and the KV cache split over the engine's TP, by the two figures
        above. An engine that holds its weights otherwise overrides it."""
        return EngineMemory.bf16_over_tp(arch, engine_tp, total_params, margin_gb=cls.MARGIN_GB,
                                         usable_fraction=cls.USABLE_FRACTION)

    @classmethod
    def push_buffer_bytes(cls, method: str, bucket_bytes: int, senders: int) -> int:
        """What one engine GPU holds for a push beside its weights and KV cache (receive buffers),
        at `weight_sync.method`, buckets of `bucket_bytes`, from `senders` owning trainer ranks
        interleaved round by round (weight_sync.buckets.owned_rounds). Counted by the planner."""
        return 0

    @classmethod
    def check_config(cls, config) -> None:
        """A ConfigError naming the field for what the run config asks and this engine cannot do:
        here every capability it asks for (capabilities.asked); an engine adds its own limits."""
        for field, capability in asked(config):
            cls.require(capability, field)

    @classmethod
    def require(cls, capability: type, asking: str) -> None:
        """A ConfigError in one line unless this engine has `capability`, which `asking` (the
        field=value, or the command, that needs it) asks for."""
        if not issubclass(cls, capability):
            raise ConfigError(f"rollout.engine={cls.name} cannot {asking}: {cls.__name__} does not implement "
                              f"{capability.__name__} ({methods(capability)})")

    # ---------------------------------------------------------------- HTTP
    def request(self, url: str, path: str, body: dict | None = None, method: str = "POST") -> object:
        """One control request's answer (JSON, or the text of a plain-text 200); a failed request
        is a WeightSyncError naming the server and the route ("HTTP 400: <the engine's
        message>", "URLError: <reason>", ...)."""
        try:
            return request_json(f"{url}{path}", body, self.timeout_s, method=method, api_key=self.api_key)
        except HTTPRequestError as err:
            raise WeightSyncError(f"server {url}{path}: {err}") from None

    def call(self, url: str, path: str, body: dict | None = None) -> object:
        """POST `body` to url+path: the answer (an engine may read its own refusals in it)."""
        return self.request(url, path, body)

    def answers(self, url: str, path: str) -> bool:
        """The server answers a GET of `path` without an error."""
        try:
            self.request(url, path, None, "GET")
            return True
        except WeightSyncError:
            return False

    def on_each(self, fn: Callable[[str], object]) -> list:
        """`fn(url)` for every server at once (a weight-update step must reach all of them)."""
        with ThreadPoolExecutor(max_workers=len(self.urls)) as pool:
            return list(pool.map(fn, self.urls))

    def on_all(self, path: str, body: dict | None = None) -> list:
        """The same call on every server at once."""
        return self.on_each(lambda url: self.call(url, path, body))

    def on_all_checked(self, path: str, body: dict | None, accepted, expected: str) -> None:
        """`on_all`, each server's answer checked (`check_answer`)."""
        for url, answer in zip(self.urls, self.on_all(path, body)):
            check_answer(url, path, answer, accepted, expected)

    # ---------------------------------------------------------------- the servers
    @abstractmethod
    def healthy(self, url: str) -> bool:
        """The server answers and can generate."""

    @abstractmethod
    def capacity(self, url: str, default: int, request_tokens: int = 0) -> int:
        """How many requests of `request_tokens` (prompt + response) the server runs at once, with
        room for each in its KV cache (`default` when it does not say)."""

    # ---------------------------------------------------------------- generation
    @property
    @abstractmethod
    def client_class(self) -> type:
        """The engine's generation client (an EngineClient: `request`, one generation; `abort_all`)."""

    def client(self, vocab_size: int, *, request_timeout_s: float = 600.0, max_attempts: int = 5,
               max_concurrency: int = 64, routing_shape: tuple[int, int] | None = None):
        """The generation client for these servers (`generate`, `generate_one`, `generate_one_async`, `close`)."""
        return self.client_class(self.urls, vocab_size, request_timeout_s=request_timeout_s, max_attempts=max_attempts,
                                 max_concurrency=max_concurrency, routing_shape=routing_shape, api_key=self.api_key)

    @abstractmethod
    def pause(self, keep_tokens: bool = True) -> None:
        """Every server stops generating before a push (asynchronous modes). `keep_tokens`: the
        running requests keep their tokens and continue after `resume`; else they are aborted."""

    @abstractmethod
    def resume(self) -> None:
        """After a push: paused requests continue under the new weights."""
