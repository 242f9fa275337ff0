"""Process group and Megatron parallel-state setup (the only place that starts them)."""

from __future__ import annotations

import os
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

from gspo_mcore.config import ConfigError, DistributedConfig
from gspo_mcore.common.netaddr import free_port

_DEVICE = torch.device("cpu")
_HOST_GROUP = None


def device() -> torch.device:
    """Where this rank's model, its inputs and our collectives' tensors live (set by
    init_distributed): the GPU under NCCL, which takes no CPU tensors; the CPU under gloo."""
    return _DEVICE


def to_device(batch: dict) -> dict:
    """A microbatch's tensors on device() (they are built on the CPU from the rollouts)."""
    return {k: host_to_device(v, _DEVICE) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def host_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device` without the host waiting for the stream: a host tensor goes through
    page-locked memory, non-blocking (from pageable memory cudaMemcpyAsync returns only once the
    copy is done, after everything queued before it). The pinned copy is torch's caching host
    allocator's, which keeps it until the copy's stream has passed it."""
    if tensor.device.type == "cpu" and device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def host_group():
    """A gloo group of every trainer rank, for waits on the host (set by init_distributed): the
    other ranks wait here for rank 0's rollout batch, a blocking socket read, where an NCCL
    broadcast would spin a kernel on their GPUs for the whole rollout (taking SMs from a
    a colocated engine) and time out with the trainer's collectives (distributed.timeout_minutes)."""
    return _HOST_GROUP


def broadcast_from_host(value, src: int = 0):
    """Rank `src`'s Python object on every rank, over the host group (CPU, gloo)."""
    box = [value]
    dist.broadcast_object_list(box, src=src, group=_HOST_GROUP)
    return box[0]


def gather_to_host(value, dst: int = 0) -> list | None:
    """Every rank's Python object, in rank order, on rank `dst` (None elsewhere), over the host group."""
    out = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(value, out, dst=dst, group=_HOST_GROUP)
    return out


def scatter_from_host(values: list | None, src: int = 0):
    """values[r] (given on rank `src`) on each rank r, over the host group."""
    box = [None]
    dist.scatter_object_list(box, values, src=src, group=_HOST_GROUP)
    return box[0]


def world_size() -> int:
    """The number of trainer ranks, before or after the process group starts (torchrun's env; 1 under plain python)."""
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


# Deprecation notices about torch calls megatron-core 0.16.1 makes (its collectives, its
# checkpoint loading), not ours: printed on every run and every resume, they buried the one-line
# messages a user reads.
UPSTREAM_DEPRECATIONS = (r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
                         r"`load_state_dict` is deprecated")


def quiet_upstream_deprecations() -> None:
    for message in UPSTREAM_DEPRECATIONS:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning)


def init_distributed(cfg: DistributedConfig, seed: int) -> None:
    """Join the process group (torchrun's env, or a world of one), set up TP/PP/EP/DP (the layout
    checked first: models.qwen3_moe.model.check_layout), and seed
    Megatron's RNG tracker (its data-, tensor- and expert-parallel states) from `seed`."""
    global _DEVICE, _HOST_GROUP
    quiet_upstream_deprecations()
    if cfg.device == "cpu":
        from gspo_mcore.megatron import cpu_bridge  # the CPU path only: it patches torch.cuda process-wide

        cpu_bridge.install()
    else:
        if not torch.cuda.is_available():
            raise ConfigError("distributed.device: 'cuda', but this machine has no usable CUDA device")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        _DEVICE = torch.device("cuda", torch.cuda.current_device())
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # plain `python`: a world of one
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group("gloo" if cfg.device == "cpu" else "nccl", timeout=timedelta(minutes=cfg.timeout_minutes))
    if _HOST_GROUP is None:  # collective: every rank creates it, once per process
        _HOST_GROUP = dist.new_group(backend="gloo", timeout=timedelta(minutes=cfg.rollout_timeout_minutes))
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=cfg.tensor_parallel,
        pipeline_model_parallel_size=cfg.pipeline_parallel,
        expert_model_parallel_size=cfg.expert_parallel,
        expert_tensor_parallel_size=cfg.expert_tensor_parallel,
    )
    model_parallel_cuda_manual_seed(seed)


def model_parallel_groups() -> list:
    """The process groups of this rank that Megatron's parallel state created (megatron-core 0.16.1
    parallel_state.create_group lists each in _global_process_group_list; None there is the world)."""
    return [group for group in parallel_state._global_process_group_list or () if group is not None]


def end_model_parallel(groups: list) -> None:
    """Undo init_distributed's Megatron part for `groups` (model_parallel_groups() when they were
    made), on every rank: each destroyed in torch (parallel_state.destroy_model_parallel only
    forgets the NCCL ones, whose communicators' memory lies outside torch's allocator), then, if
    Megatron's state still holds them, that state, its global memory buffer and the RNG tracker
    reset. The world and host groups stay: one per process (gspo_mcore.run.start ends the world)."""
    # destroy_model_parallel reads the same private map before destroying its gloo groups.
    live = dist.distributed_c10d._world.pg_map
    current = model_parallel_groups()
    for group in groups:
        if group in live:
            dist.destroy_process_group(group)
    if len(current) == len(groups) and all(a is b for a, b in zip(current, groups)):
        parallel_state.destroy_model_parallel()
        get_cuda_rng_tracker().reset()
