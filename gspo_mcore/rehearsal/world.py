"""A fake world of the config's size around one real rank: torch's fake process group
(torch.testing._internal.distributed.fake_pg: every collective returns at once, nothing moves),
with what megatron-core and this project ask of it bridged:

- gloo and nccl `new_group`s (megatron's gloo groups for the distributed optimizer,
  process_groups_config.py -> parallel_state.py; the project's host group) are fake groups too:
  gloo on a FakeStore raises "Not implemented" (c10d/init.cpp).
- Object collectives run outside the fake tensor mode (distributed_c10d pickles through real
  tensors) and hand every rank this rank's own objects; a slot this rank left None in a
  broadcast from another rank becomes {} (Learner._report's metrics from the last pipeline stage:
  another rank's figures, which a lone rank cannot have).
- c10d's coalescing manager (param_and_grad_buffer.py, the gradient reduce-scatter) has no fake
  kernel for its coalesced ops: the ops inside it run one by one, and a finished work object
  stands for the coalesced one.
- all_to_all_single takes the split sizes as int lists (megatron passes numpy arrays and tensors).
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _disable_current_modes

from gspo_mcore.megatron.cpu_bridge import _all_to_all_single_with_int_splits


class _DoneWork:
    """A collective's work that has finished (nothing moves in a fake world)."""

    def wait(self, *args, **kwargs):
        return True

    def is_completed(self):
        return True

    def get_future(self):
        future = torch.futures.Future()
        future.set_result(None)
        return future


def _outside_modes(function):
    def call(*args, **kwargs):
        with _disable_current_modes():
            return function(*args, **kwargs)
    return call


def _all_gather_object(object_list, obj, group=None):
    for i in range(len(object_list)):
        object_list[i] = obj


def _broadcast_object_list(object_list, src=None, group=None, device=None, group_src=None):
    for i, value in enumerate(object_list):
        if value is None:
            object_list[i] = {}


def _gather_object(obj, object_gather_list=None, dst=None, group=None, group_dst=None):
    if object_gather_list is not None:
        for i in range(len(object_gather_list)):
            object_gather_list[i] = obj


def _scatter_object_list(scatter_object_output_list, scatter_object_input_list=None, src=None, group=None,
                         group_src=None):
    if scatter_object_input_list:
        scatter_object_output_list[0] = scatter_object_input_list[dist.get_rank() % len(scatter_object_input_list)]


@contextlib.contextmanager
def _coalescing_manager(group=None, device=None, async_ops=False):
    class Manager:
        works = [_DoneWork()]

        def wait(self):
            pass

    yield Manager()


def join(rank: int, world_size: int) -> None:
    """This process as rank `rank` of a fake world of `world_size` (torchrun's environment set as
    the trainer reads it), and the bridges above installed."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    local = rank % torch.cuda.device_count()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local),
                      LOCAL_WORLD_SIZE=str(min(world_size, torch.cuda.device_count())),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    new_group = dist.new_group

    def fake_new_group(*args, **kwargs):
        kwargs["backend"] = "fake"
        kwargs.pop("pg_options", None)
        return new_group(*args, **kwargs)

    dist.new_group = dist.distributed_c10d.new_group = fake_new_group
    for name, function in (("all_gather_object", _all_gather_object), ("broadcast_object_list", _broadcast_object_list),
                           ("gather_object", _gather_object), ("scatter_object_list", _scatter_object_list)):
        setattr(dist, name, _outside_modes(function))
        setattr(dist.distributed_c10d, name, getattr(dist, name))
    dist._coalescing_manager = dist.distributed_c10d._coalescing_manager = _coalescing_manager
    dist.all_to_all_single = _all_to_all_single_with_int_splits(dist.all_to_all_single)  # int lists, as gloo takes
