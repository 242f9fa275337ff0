"""Section 6 (CUDA): the NCCL calls of vLLM's NCCL push as the trainer makes them
(gspo_mcore.engines.vllm.nccl: unique_id, current_device, communicator, broadcast, wait, version, close),
twice: the communicator joined on a thread of its own on this rank's device, a 1 GiB broadcast
(world of one), closed; then the same again. The GPU's used memory (the driver's figure: NCCL's
buffers are outside torch's allocator) after the second close is that after the first: a reopen
leaks nothing. No model: it runs in the parent."""

from __future__ import annotations

import threading
import time

LEAK_TOLERANCE_MB = 32  # the driver's used memory may move by a few MiB between two readings
BROADCAST_BYTES = 2**30


def one_round(nccl, device: int) -> dict:
    """Open, broadcast 1 GiB, close; the figures and the GPU's used MiB after the close."""
    import torch

    uid, joined = nccl.unique_id(), {}

    def join():
        try:
            joined["group"] = nccl.communicator(1, uid, device)
            joined["thread_device"] = torch.cuda.current_device()
        except Exception as err:  # noqa: BLE001 (raised on the joining thread: carried to the caller)
            joined["error"] = err

    thread = threading.Thread(target=join)
    thread.start()
    thread.join(120)
    if "group" not in joined:
        raise joined.get("error") or TimeoutError("nccl.communicator: not joined within 120 s")
    flat = torch.randint(0, 256, (BROADCAST_BYTES,), device="cuda", dtype=torch.uint8)
    head = flat[:4096].clone()
    torch.cuda.synchronize()
    began = time.perf_counter()
    nccl.broadcast(joined["group"], flat)
    nccl.wait(joined["group"], "(the check's world of one)", 60.0)  # the event and async-error poll a push uses
    seconds = time.perf_counter() - began
    torch.cuda.synchronize(device)
    intact = bool((flat[:4096] == head).all())  # world of one: the root's data stays
    nccl.close(joined["group"])
    del flat, head, joined["group"]
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return {"joined_on_device": joined["thread_device"], "broadcast_s": seconds, "data_intact": intact,
            "used_after_close_mb": (total - free) / 2**20}


def section_6(check) -> dict:
    if check.device != "cuda":
        return {"skip": "NCCL needs a GPU"}
    import torch

    from gspo_mcore.engines.vllm import nccl

    device = nccl.current_device()
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    first, second = one_round(nccl, device), one_round(nccl, device)
    leak = second["used_after_close_mb"] - first["used_after_close_mb"]
    found = nccl.version()
    return {"nccl": ".".join(map(str, found)), "rank_device": device,
            # vLLM 0.33's own binding needs 2.29.7 (nccl.VLLM_NEEDS): torch 2.11's wheel is older; said, not failed
            "vllm_transfer_nccl_ok": found >= nccl.VLLM_NEEDS,
            "broadcast_gib": BROADCAST_BYTES / 2**30, "broadcast_s": first["broadcast_s"],
            "reopen_broadcast_s": second["broadcast_s"], "used_before_mb": (total - free) / 2**20,
            "used_after_first_close_mb": first["used_after_close_mb"],
            "used_after_second_close_mb": second["used_after_close_mb"], "reopen_leak_mb": leak,
            "leak_tolerance_mb": LEAK_TOLERANCE_MB,
            "pass": all(r["joined_on_device"] == device and r["data_intact"] for r in (first, second))
                    and leak <= LEAK_TOLERANCE_MB}
