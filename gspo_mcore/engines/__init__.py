"""Inference engines behind one interface (`Engine`, gspo_mcore/engines/base.py: the core; the
optional capabilities in gspo_mcore/engines/capabilities.py), one package each, chosen by
`rollout.engine`. Adding one: a package here with a class implementing `Engine` and the
capabilities it supports, its name in `ENGINES` and in `RolloutConfig.engine`'s choices
(docs/11-code-map.md, "Adding an engine")."""

from __future__ import annotations

import importlib
import time
from contextlib import ExitStack
from pathlib import Path

from gspo_mcore.engines.base import Engine, EngineMemory, check_sampling_params
from gspo_mcore.common.processes import ManagedServer

# rollout.engine -> the class implementing it (imported when asked for: an engine's package may
# import that engine's own heavy modules).
ENGINES = {"sglang": "gspo_mcore.engines.sglang.engine:SGLangEngine",
           "vllm": "gspo_mcore.engines.vllm.engine:VLLMEngine"}


def engine_class(name: str) -> type[Engine]:
    module, _, attribute = ENGINES[name].partition(":")
    return getattr(importlib.import_module(module), attribute)


def connect(config, urls: list[str], api_key: str | None = None) -> Engine:
    """The run's servers (`urls`) as its engine speaks to them."""
    return engine_class(config.rollout.engine)(urls, timeout_s=config.rollout.request_timeout_s, api_key=api_key)


def requests_in_flight(capacities: list[int]) -> int:
    """What the rollout client keeps in flight over servers that each run `capacities[i]` at once:
    one slot per server kept free for the sync check's probes (at least one request each)."""
    return sum(max(1, n - 1) for n in capacities)


def start_servers(config, log_dir: Path, stack: ExitStack, api_key: str | None = None) -> list[str]:
    """The CPU default / tests: `rollout.num_servers` servers of the config's engine for
    model.hf_dir that the run owns, on 127.0.0.1 (behind `api_key`), stopped when `stack` closes.
    They start at once (each loads the model and warms up on its own); returns their URLs once
    all are healthy."""
    kind = engine_class(config.rollout.engine)
    servers, count = [], config.rollout.num_servers
    env = kind.launch_command(config, 0, api_key=api_key)[1]  # the same for every port
    for index in range(count):
        server = ManagedServer.on_free_port(lambda port: kind.launch_command(config, port, api_key=api_key)[0],
                                            log_dir / f"{kind.name}_{index}.log", env=env, secrets=(api_key,))
        stack.callback(server.stop)
        servers.append(server.launch())
    print(f"starting {count} {kind.name} server(s) for {config.model.hf_dir} (logs: {log_dir}/{kind.name}_*.log)",
          flush=True)
    began = time.monotonic()
    for server in servers:
        server.ready()
    print(f"{count} server(s) ready after {time.monotonic() - began:.0f} s", flush=True)
    return [server.url for server in servers]


__all__ = ["Engine", "EngineMemory", "ENGINES", "check_sampling_params", "connect", "engine_class", "requests_in_flight", "start_servers"]
