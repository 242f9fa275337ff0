"""The trainer's end of the process group an SGLang server joins for weight pushes, without
importing SGLang.

`sglang.srt.utils.common.init_custom_process_group` (0.5.23) builds a group outside the default
one (the trainer's own torch.distributed world stays as it is) from a store: the server's TP
workers call it as ranks 1..tp on `/init_weights_update_group`, the trainer as rank 0. Imported
from SGLang, the function cost each run's rank 0 3.2 s of CPU (the package's import: transformers,
torchvision, its server modules), for the ten lines below: the same two calls of torch's c10d
(`_new_process_group_helper` on the store; the group's ranks mapped to themselves in `_world`),
on the store path, the only one the trainer takes. tests/test_sglang_server.py pushes through it
to a real server, as every SGLang run with `weight_sync.method: distributed` does."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, _new_process_group_helper, _world


def weight_update_group(backend: str, store: dist.Store, world_size: int, rank: int, group_name: str,
                        timeout: timedelta) -> dist.ProcessGroup:
    """A `world_size`-rank group of `backend` over `store` (already prefixed with the group's name,
    as the servers' is), this process being `rank`."""
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                         backend_options=None, timeout=timeout, device_id=None)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group
