"""The trainer's end of vLLM's CUDA IPC weight transfer (the "ipc" backend of
vllm/distributed/weight_transfer/ipc_engine.py, packed: IPCWeightTransferUpdateInfo with
`ipc_handles_pickled`) without vLLM in the trainer's Python. CUDA only; the engine calls these
through this module so a test can stand in for them."""

from __future__ import annotations

import base64
import pickle

import torch


def export(flat: torch.Tensor) -> tuple[str, tuple]:
    """This GPU's UUID (as the worker finds its own: str(get_device_properties(i).uuid)) and the
    arguments torch's rebuild_cuda_tensor takes to map `flat` in another process
    (torch.multiprocessing.reductions.reduce_tensor: the segment's IPC handle, offsets, a
    reference counter the consumer releases, an event it waits on). Frees first what earlier
    exports' consumers have released (torch.cuda.ipc_collect)."""
    from torch.multiprocessing.reductions import reduce_tensor

    torch.cuda.ipc_collect()
    _, args = reduce_tensor(flat)
    return str(torch.cuda.get_device_properties(flat.device).uuid), args


def pickled(handles: dict[str, tuple]) -> str:
    """`ipc_handles_pickled`: base64 of the pickled {uuid: args}. The pickle names only torch's
    Tensor, Size, storage and dtype types besides bytes and numbers, so vLLM's torch, another
    version than ours, reads it."""
    return base64.b64encode(pickle.dumps(handles)).decode()
