"""Section 5 (CUDA): the colocated CUDA-IPC push as the trainer makes it (gspo_mcore.engines.vllm:
pack_bucket, shared_payload) to a reader process that maps it as vLLM 0.33's IPC engine does and
reads it with vLLM's own `packed_tensor.unpack_tensor`: every tensor equal, the trainer's memory
back to its start after two pushes. No model: it runs in the parent."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

IPC_READER = r"""
import base64, hashlib, json, pickle, sys
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor
from packed_tensor import unpack_tensor  # vLLM 0.33's, from the wheel folder
# As vLLM's IPC engine maps an export: rebuild_cuda_tensor's arguments pickled by the trainer,
# keyed by this GPU's UUID (ipc_engine.IPCWeightTransferEngine.receive_weights).
for line in sys.stdin:
    info = json.loads(line)
    handles = pickle.loads(base64.b64decode(info["ipc_handles_pickled"]))
    args = list(handles[str(torch.cuda.get_device_properties(0).uuid)])
    args[6] = 0  # the storage's device index, in this process (one visible GPU)
    flat = rebuild_cuda_tensor(*args)
    dtypes = [getattr(torch, d) for d in info["dtype_names"]]
    tensors = unpack_tensor(flat, info["names"], info["shapes"], dtypes, info["tensor_sizes"])
    print(json.dumps({name: hashlib.sha256(t.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()
                      for name, t in tensors}), flush=True)
    del flat, tensors
    torch.cuda.ipc_collect()
"""


def section_5(check) -> dict:
    if check.device != "cuda":
        return {"skip": "CUDA IPC needs a GPU"}
    import torch

    from gpucheck.shape import free_memory
    from gspo_mcore.engines.vllm.engine import VLLMEngine

    engine = VLLMEngine(["http://stand-in"])
    engine.prepare_sharing(on_gpu=True)
    reader = subprocess.Popen([sys.executable, "-c", IPC_READER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    equal, g = True, torch.Generator(device="cuda").manual_seed(0)
    for push in range(2):
        bucket = [(f"model.layers.{i}.mlp.experts.{push}.down_proj.weight",
                   torch.randn(2048, 768, device="cuda", generator=g).to(torch.bfloat16)) for i in range(64)]
        flat = engine.pack_bucket(bucket)
        torch.cuda.synchronize()
        payload = engine.shared_payload(flat, [(n, tuple(t.shape)) for n, t in bucket], torch.bfloat16)
        reader.stdin.write(json.dumps(payload) + "\n")
        reader.stdin.flush()
        read = json.loads(reader.stdout.readline())
        equal &= read == {n: hashlib.sha256(t.view(torch.uint8).cpu().numpy().tobytes()).hexdigest() for n, t in bucket}
        del bucket, flat
    reader.stdin.close()
    reader.wait(60)
    torch.cuda.ipc_collect()
    free_memory()
    left = (torch.cuda.memory_allocated() - start) / 2**20
    return {"pushes": 2, "bucket_mb": 64 * 2048 * 768 * 2 / 2**20, "tensors_equal": equal,
            "memory_left_mb": left, "reserved_mb": torch.cuda.memory_reserved() / 2**20,
            "pass": equal and left < 1 and reader.returncode == 0}
