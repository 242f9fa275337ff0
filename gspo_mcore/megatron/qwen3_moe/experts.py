"""The `torch` spec's MoE experts: each of a layer's two expert GEMMs, over all its local experts, as one
grouped GEMM (torch._grouped_mm, as torchtitan's GroupedExperts does), with nothing beyond PyTorch and
megatron-core.

Megatron's interface, SequentialMLP's contract (megatron-core 0.16.1 transformer/moe/experts.py): MoELayer
builds it as `experts(num_local_experts, config, pg_collection=...)` (a spec's `submodules` are accepted and
unused); `forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)` -> (output, None) takes the
tokens sorted by local expert, as Megatron's token dispatcher (alltoall or allgather) hands them over, with
`tokens_per_expert` [local experts] their counts; each token's router probability scales the activation
before fc2, as in MLP.forward. All communication is the dispatcher's: the experts compute on what they hold
(with expert TP, Megatron's expert linears communicate no more: `explicit_expert_comm` in
tensor_parallel/layers.py), so EP, expert TP and sequence parallel need nothing here.

Weights: `weight1` [local experts, this expert-TP rank's fc1 rows, hidden] and `weight2` [local experts,
hidden, this rank's ffn columns]. Slice e is exactly SequentialMLP's `local_experts.e.linear_fc1.weight` /
`linear_fc2.weight` (nn.Linear's [out, in]; fc1's rows are this rank's [gate; up], Megatron's GLU layout), so
- the checkpoint is SequentialMLP's: `sharded_state_dict` gives the same keys, dict keys, shapes, offsets,
  replica ids and `_extra_state` objects, built on per-expert views by megatron-core's own
  make_sharded_tensors_for_checkpoint and apply_swiglu_sharded_factory; a load pre-hook stacks the
  per-expert tensors a load returns back into the parameters. torch_dist checkpoints, the converter and the
  HF export are those of every spec;
- parallel_weights moves HF tensors into and out of per-expert views under the local spec's names;
- nothing is copied per call: torch._grouped_mm reads `weight.transpose(-2, -1)` (a view; its kernel takes
  either major order).
Not megatron's GroupedMLP layout ([hidden, experts * out]): its checkpoint needs a transposing factory, which
megatron-core itself notes leaves optimizer states incompatible with SequentialMLP's.

Kernels by name (`grouped_kernel`), chosen by the operands' device and dtype, never by a silent fallback:
- CUDA, bfloat16, sm90 / sm100: torch._grouped_mm, whose fast path (aten/src/ATen/native/cuda/GroupedBlas.cpp
  `_grouped_mm_cuda`) needs all-bf16 operands on a device `_scaled_mm_allowed_device(sm90_only, sm100_only)`
  accepts (major 9 or 10); offsets are int32 cumulative token counts on the device, no host sync. Rows must
  be 16-byte aligned (`check_valid_strides_and_return_transposed`: hidden and ffn sizes multiples of 8 in
  bf16); token counts need no padding in bf16 (torchtitan pads only for fp8 / mxfp8), and an expert without
  tokens gets a zero gradient on Hopper; on sm100 it does not (pytorch/pytorch#172439, open), so there the
  weight's gradient is zeroed for experts without tokens (`ZeroEmptyExpertGrads`: a masked multiply in backward).
- CUDA, bfloat16 on any other GPU (sm80, sm89, ...), or another half dtype: refused in one line. torch would
  run its `_grouped_mm_fallback` there, a per-expert loop with a device-to-host sync: that is `local`.
- float32 anywhere, and everything on CPU: an exact per-expert loop of `x_e @ w_e^T`, the matmul
  ColumnParallelLinear / RowParallelLinear compute in SequentialMLP (the `torch` spec's forward equals
  `local`'s bit for bit there). torch has no float32 grouped kernel (on CUDA it would run the same loop, with
  the sync); float32 is the parity checks' dtype, not a training speed path.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from megatron.core.dist_checkpointing.mapping import ShardedStateDict
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name
from megatron.core.transformer.mlp import MLPSubmodules, apply_swiglu_sharded_factory
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint
from megatron.core.utils import divide

from gspo_mcore.common.errors import InputError
from gspo_mcore.megatron.parallel import host_to_device

GROUPED_MM, LOOP = "grouped_mm", "loop"
# TMA: every row stride of a _grouped_mm operand, in forward (x: k, the weight: k) and backward (the output's
# gradient, an operand of both gradient GEMMs: n).
_ROW_ALIGN_BYTES = 16


def grouped_kernel(device: torch.device, dtype: torch.dtype, k: int, n: int,
                   capability: Optional[tuple[int, int]] = None) -> str:
    """The kernel `grouped_matmul` runs for x [tokens, k] and weight [experts, n, k] of `dtype` on `device`:
    GROUPED_MM or LOOP (the module docstring says when), or an InputError naming why neither may.
    `capability`: the CUDA device's compute capability (read from the device when None)."""
    if device.type != "cuda" or dtype == torch.float32:
        return LOOP
    if dtype != torch.bfloat16:
        raise InputError(f"model.spec 'torch': torch._grouped_mm's grouped kernel takes bfloat16, not {dtype}")
    major, minor = capability if capability is not None else torch.cuda.get_device_capability(device)
    if major not in (9, 10):
        raise InputError(f"model.spec 'torch': torch._grouped_mm's bfloat16 kernel needs an sm90 or sm100 GPU, "
                         f"not sm{major}{minor}, where torch loops over the experts (use model.spec 'local')")
    align = _ROW_ALIGN_BYTES // dtype.itemsize
    for size, what in ((k, "input"), (n, "output")):
        if size % align:
            raise InputError(f"model.spec 'torch': torch._grouped_mm needs 16-byte rows: an expert GEMM's {what} "
                             f"size {size} is not a multiple of {align} in {dtype}")
    return GROUPED_MM


def expert_offsets(tokens_per_expert: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[experts] int32 end row of each expert's tokens, on `device` (torch._grouped_mm's `offs`). Megatron's
    alltoall dispatcher hands the counts over on the host (`_maybe_dtoh_and_synchronize`): one small copy,
    pinned and non-blocking, so the host runs on (the rehearsal lists copies it waits on)."""
    return torch.cumsum(host_to_device(tokens_per_expert, device), dim=0, dtype=torch.int32)


def grouped_matmul(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Each expert's rows times its weight: out[offsets[e-1]:offsets[e]] = x[offsets[e-1]:offsets[e]] @ weight[e]^T.

    x [tokens, k] sorted by expert, weight [experts, n, k] (nn.Linear's layout per expert), offsets [experts]
    int32 cumulative token counts ending at `tokens`, all on one device -> [tokens, n] there, differentiable in
    x and weight. The kernel is `grouped_kernel`'s choice; no tokens at all take the loop (empty matmuls,
    weight still in the graph: a zero gradient)."""
    kernel = grouped_kernel(x.device, x.dtype, x.shape[-1], weight.shape[-2])
    if kernel == GROUPED_MM and x.shape[0] > 0:
        if zeroes_empty_expert_grads(device_capability(x.device)):
            weight = ZeroEmptyExpertGrads.apply(weight, offsets)
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
    ends = offsets.tolist() if x.shape[0] else [0] * weight.shape[0]  # the host sync of the loop (none on CPU)
    counts = [end - start for start, end in zip([0, *ends[:-1]], ends)]
    return torch.cat([torch.matmul(rows, w.t()) for rows, w in zip(x.split(counts), weight.unbind(0))])


def device_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def zeroes_empty_expert_grads(capability: tuple[int, int]) -> bool:
    """Whether the grouped kernel's weight gradient must be zeroed for experts without tokens on a device of
    `capability`: on sm100 (B200) `_grouped_mm` leaves it not zero (pytorch/pytorch#172439, open), and a
    filler microbatch (gspo/packing.py: all padding) leaves most of 128 experts empty; Hopper writes zeros."""
    return capability[0] == 10


class ZeroEmptyExpertGrads(torch.autograd.Function):
    """The identity on an expert weight [experts, n, k] whose gradient is zero for each expert that `offsets`
    (int32 cumulative token counts, on the device) gives no tokens: one masked multiply of the weight
    gradient in backward, no host sync."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(offsets)
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (offsets,) = ctx.saved_tensors
        counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
        return grad * (counts > 0).to(grad.dtype).view(-1, *([1] * (grad.dim() - 1))), None


class TorchGroupedMLP(MegatronModule):
    """SequentialMLP's interface and checkpoint with the local experts' weights stacked and computed by
    `grouped_matmul` (see the module docstring)."""

    def __init__(self, num_local_experts: int, config: TransformerConfig,
                 submodules: Optional[MLPSubmodules] = None, pg_collection: Optional[ProcessGroupCollection] = None):
        super().__init__(config=config)
        _refuse_unsupported(config)
        self.num_local_experts = num_local_experts
        self.ep_group, self.tp_group, self.dp_group = pg_collection.ep, pg_collection.expt_tp, pg_collection.expt_dp
        hidden = config.hidden_size
        ffn = divide(config.moe_ffn_hidden_size, self.tp_group.size())
        fc1_rows = 2 * ffn if config.gated_linear_unit else ffn
        device = torch.device("cpu") if config.use_cpu_initialization else torch.device(
            "cuda", torch.cuda.current_device())
        for k, n in ((hidden, fc1_rows), (ffn, hidden)):  # refused at build, not at the first forward
            grouped_kernel(device, config.params_dtype, k, n)
        self.weight1 = torch.nn.Parameter(
            torch.empty(num_local_experts, fc1_rows, hidden, device=device, dtype=config.params_dtype))
        self.weight2 = torch.nn.Parameter(
            torch.empty(num_local_experts, hidden, ffn, device=device, dtype=config.params_dtype))
        # ColumnParallelLinear's / RowParallelLinear's attributes of an expert weight, on the stacked dim.
        expert_parallel = config.expert_model_parallel_size > 1
        for weight, partition_dim in ((self.weight1, 1), (self.weight2, 2)):
            set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=partition_dim, stride=1)
            weight.allreduce = not expert_parallel
        if config.perform_initialization:
            self._initialize()
        self._register_load_state_dict_pre_hook(self._stack_per_expert_tensors)

    @torch.no_grad()
    def _initialize(self) -> None:
        # As megatron-core's expert linears: the expert-parallel RNG stream on the GPU, the default one on CPU.
        fork = (contextlib.nullcontext() if self.config.use_cpu_initialization
                else get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()))
        with fork:
            self.config.init_method(self.weight1)
            self.config.output_layer_init_method(self.weight2)

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor) -> tuple[torch.Tensor, None]:
        """[tokens, hidden] sorted by local expert, their counts, [tokens] router probabilities -> [tokens, hidden]
        (partial sums over expert TP, which the dispatcher reduces), on the tokens' device."""
        hidden, probs = permuted_local_hidden_states, permuted_probs.unsqueeze(-1)
        if self.config.moe_apply_probs_on_input:  # as SequentialMLP: scale the input, not the activation
            hidden, probs = (probs * hidden).to(hidden.dtype), None
        offsets = expert_offsets(tokens_per_expert, hidden.device)
        intermediate = self._activation(grouped_matmul(hidden, self.weight1, offsets))
        if probs is not None:
            intermediate = (intermediate * probs).to(intermediate.dtype)  # MLP.forward's per_token_scale
        return grouped_matmul(intermediate, self.weight2, offsets), None

    def _activation(self, fc1: torch.Tensor) -> torch.Tensor:
        """MLP.forward's unfused activation (megatron-core 0.16.1 transformer/mlp.py), the `local` spec's."""
        config = self.config
        if not config.gated_linear_unit:
            return config.activation_func(fc1)
        gate, linear = torch.chunk(fc1, 2, dim=-1)
        if (clamp := config.activation_func_clamp_value) is not None:
            gate, linear = gate.clamp(min=None, max=clamp), linear.clamp(min=-clamp, max=clamp)
        return config.activation_func(gate) * (linear + config.glu_linear_offset)

    def backward_dw(self) -> None:
        """No deferred weight gradients (SequentialMLP's and GroupedMLP's interface)."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None) -> ShardedStateDict:
        """SequentialMLP.sharded_state_dict on per-expert views: the same entries, key for key."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        singleton = metadata.get("singleton_local_shards", False)
        num_global = self.ep_group.size() * self.num_local_experts
        first = self.ep_group.rank() * self.num_local_experts
        sharded = {}
        for i in range(self.num_local_experts):
            local_prefix = f"{prefix}local_experts.{i}."
            if singleton:
                sharded_prefix, offsets = f"{prefix}experts.{first + i}.", sharded_offsets
            else:
                sharded_prefix = f"{prefix}experts."
                offsets = (*sharded_offsets, (len(sharded_offsets), first + i, num_global))
            expert = {}
            # ColumnParallelLinear shards its weight on axis 0, RowParallelLinear on 1; both carry an _extra_state.
            for linear, weight, tp_axis in (("linear_fc1", self.weight1, 0), ("linear_fc2", self.weight2, 1)):
                entries = make_sharded_tensors_for_checkpoint(
                    {"weight": weight[i], "_extra_state": None}, f"{local_prefix}{linear}.", {"weight": tp_axis},
                    offsets, tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])
                if linear == "linear_fc1" and self.config.gated_linear_unit:  # MLP.sharded_state_dict's GLU split
                    key = f"{local_prefix}{linear}.weight"
                    entries[key] = apply_swiglu_sharded_factory(entries[key], offsets, singleton)
                expert.update(entries)
            replace_prefix_for_sharding(expert, local_prefix, sharded_prefix)
            for entry in expert.values():  # replicated over expert-DP, as SequentialMLP sets it
                entry.replica_id = (*entry.replica_id[:2], self.dp_group.rank())
            sharded.update(expert)
        return sharded

    def _stack_per_expert_tensors(self, state_dict: dict, prefix: str, *args) -> None:
        """A load of `sharded_state_dict` returns SequentialMLP's per-expert entries: stacked back into
        `weight1` / `weight2` (their `_extra_state`, None, dropped). A partial set is left for
        load_state_dict to report (missing weight, unexpected keys)."""
        for name, linear in (("weight1", "linear_fc1"), ("weight2", "linear_fc2")):
            keys = [f"{prefix}local_experts.{i}.{linear}.weight" for i in range(self.num_local_experts)]
            if f"{prefix}{name}" not in state_dict and all(key in state_dict for key in keys):
                state_dict[f"{prefix}{name}"] = torch.stack([state_dict.pop(key) for key in keys])
                for i in range(self.num_local_experts):
                    state_dict.pop(f"{prefix}local_experts.{i}.{linear}._extra_state", None)

    def expert_weights(self) -> list[tuple[str, torch.Tensor, torch.nn.Parameter, int]]:
        """(SequentialMLP's name below this module, one expert's weight as a view, the parameter it is a view of,
        its TP partition dim in the view) of every local expert, in SequentialMLP's order (expert by expert,
        fc1 then fc2): what parallel_weights moves HF tensors into and out of."""
        return [(f"local_experts.{i}.{linear}.weight", weight[i], weight, weight.partition_dim - 1)
                for i in range(self.num_local_experts)
                for linear, weight in (("linear_fc1", self.weight1), ("linear_fc2", self.weight2))]

def _refuse_unsupported(config: TransformerConfig) -> None:
    """What the `local` spec's MLP experts would run and these do not, one line each."""
    refused = [
        (config.add_bias_linear, "expert biases (add_bias_linear)"),
        (config.fp8 or config.fp4, "fp8 / fp4 (model.spec 'te')"),
        (config.moe_latent_size is not None, "a latent MoE projection (moe_latent_size)"),
        (config.use_te_activation_func, "Transformer Engine's activation (use_te_activation_func)"),
    ]
    for present, what in refused:
        if present:
            raise InputError(f"model.spec 'torch': the grouped experts do not support {what}")
