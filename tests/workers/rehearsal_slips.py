"""Copies of project functions with one GPU-only slip each, run under the rehearsal's mode on fake
CUDA (a process of its own: the fake devices load before torch). Prints one JSON line: per slip,
the rehearsal's one-line error (or null where it ran through), and the honest copies' outcome."""

import json
import sys

from gspo_mcore.rehearsal import device

device.load()
import torch  # noqa: E402

from gspo_mcore.rehearsal.mode import FakeCuda, Mismatch, rehearsed  # noqa: E402
from gspo_mcore.rehearsal.plan import RoutingPlan  # noqa: E402


# gspo_mcore/megatron/qwen3_moe/experts.py expert_offsets, as written, and with its slips
def expert_offsets(tokens_per_expert, device):
    return torch.cumsum(tokens_per_expert.to(device=device), dim=0, dtype=torch.int32)


def expert_offsets_left_on_host(tokens_per_expert, device):
    return torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)  # SLIP: the .to(device) dropped


def expert_offsets_int64(tokens_per_expert, device):
    return torch.cumsum(tokens_per_expert.to(device=device), dim=0)  # SLIP: int64, the default


# gspo_mcore/megatron/qwen3_moe/experts.py grouped_matmul's GEMM (the grouped kernel on sm90)
def grouped_matmul(x, weight, offsets):
    return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)


# a bf16 linear layer's GEMM, as written and with an activation left in float32
def linear(x, weight):
    return torch.nn.functional.linear(x, weight)


def linear_float32_activation(x, weight):
    return torch.nn.functional.linear(x.float(), weight)  # SLIP: float32 into a bf16 GEMM


def add_host_tensor(x, bias_on_host):
    return x + bias_on_host  # SLIP: a host tensor (not a 0-d scalar) into a device op


# experts.py expert_offsets's copy now (parallel.host_to_device), and a copy the host waits on
def expert_offsets_pinned(tokens_per_expert, device):
    return torch.cumsum(tokens_per_expert.pin_memory().to(device, non_blocking=True), dim=0, dtype=torch.int32)


def expert_offsets_pageable_non_blocking(tokens_per_expert, device):
    return torch.cumsum(tokens_per_expert.to(device, non_blocking=True), dim=0, dtype=torch.int32)  # SLIP: waits


# reads the host waits on the device for (a GPU sync each: the lines marked "waits"), and not
def host_reads(x):
    x.sum().item()  # waits: a scalar
    if (x > 0).any():  # waits: a truth test
        pass
    x[:4].cpu()  # waits: a blocking copy to the host
    x[:4].to("cpu", non_blocking=True)  # queued: read after a sync elsewhere
    x[:2, :4].tolist()  # waits: one copy, not one per element
    torch.cuda.current_stream().synchronize()  # waits
    torch.cuda.synchronize()  # waits


def attempt(function, *args):
    try:
        function(*args)
        return None
    except Mismatch as error:
        return str(error)


def main() -> None:
    experts, hidden, ffn = 8, 64, 32
    out = {}
    with rehearsed(RoutingPlan(experts, 2, 1)) as mode:
        cuda = torch.device("cuda", 0)
        counts = torch.tensor([3, 0, 5, 1, 2, 4, 0, 1])  # on the host, as megatron hands them over
        x = torch.randn(sum(counts.tolist()), hidden, device=cuda, dtype=torch.bfloat16)
        w1 = torch.randn(experts, 2 * ffn, hidden, device=cuda, dtype=torch.bfloat16)
        dense = torch.randn(2 * ffn, hidden, device=cuda, dtype=torch.bfloat16)
        out["honest"] = [attempt(lambda: grouped_matmul(x, w1, expert_offsets(counts, cuda))),
                         attempt(linear, x, dense), attempt(add_host_tensor, x, torch.zeros(()))]
        out["offsets on the host"] = attempt(lambda: grouped_matmul(x, w1, expert_offsets_left_on_host(counts, cuda)))
        out["int64 offsets"] = attempt(lambda: grouped_matmul(x, w1, expert_offsets_int64(counts, cuda)))
        out["float32 into bf16"] = attempt(linear_float32_activation, x, dense)
        out["host tensor into a device op"] = attempt(add_host_tensor, x, torch.zeros(hidden))
        mode.blocking_copies.clear()
        expert_offsets_pinned(counts, cuda)
        expert_offsets_pageable_non_blocking(counts, cuda)
        expert_offsets(counts, cuda)
        out["blocking copies"] = mode.blocking_copies
        mode.host_waits.clear()
        host_reads(x)
        out["host waits"] = mode.host_waits
    with FakeCuda(allow_non_fake_inputs=True):  # fake tensors alone: the meta kernels check no dtype
        x = torch.randn(4, hidden, device="cuda", dtype=torch.bfloat16)
        dense = torch.randn(2 * ffn, hidden, device="cuda", dtype=torch.bfloat16)
        out["float32 into bf16 without the mode"] = attempt(linear_float32_activation, x, dense)
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
