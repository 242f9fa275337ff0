"""Token log-probs (and entropy) from vocabulary-parallel logits, without gathering the vocabulary.

Under tensor parallelism each rank holds logits for a contiguous slice of the vocabulary.
log p(y) = z_y - logsumexp(z) needs only three all-reduces of per-row scalars (max, sum of
exponentials, the target's logit). Rows are processed in chunks so that the float32
temporaries stay small: the only tensor of logits size that this adds is the gradient.

`LinearLogits` (the logits as their two factors, hidden states and the output layer's weight)
goes further: the output layer and the log-probs are computed together a block of the
vocabulary at a time, and the [tokens, vocabulary] logits never exist, neither in the forward
nor as a gradient (the fused linear log-probs of NeMo-RL's `use_fused_linear_logprobs`, Liger's
fused linear cross-entropy). Saved for the backward: the hidden states and the per-token
log-sum-exp (and entropy); the backward computes each block's logits again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_CHUNK_ELEMENTS = 1 << 24  # float32 temporaries of 64 MB per chunk


def _all_reduce(tensor, op, group):
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _rank_and_size(group) -> tuple[int, int]:
    if group is None or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _target_logit(z: torch.Tensor, target: torch.Tensor, first_id: int) -> torch.Tensor:
    """z[row, target - first_id] where the target falls in z's columns, else 0."""
    t = target - first_id
    here = (t >= 0) & (t < z.shape[1])
    return z.gather(1, t.clamp(0, z.shape[1] - 1)[:, None])[:, 0] * here


def _scatter_target(g: torch.Tensor, target: torch.Tensor, first_id: int, values: torch.Tensor) -> None:
    """g[row, target - first_id] += values[row] where the target falls in g's columns."""
    t = target - first_id
    here = (t >= 0) & (t < g.shape[1])
    g.scatter_add_(1, t.clamp(0, g.shape[1] - 1)[:, None], (values * here)[:, None])


def _logits_grad(z, lse, mean_z, target, first_id, g_out, g_entropy_t):
    """d(sum of weighted log-probs and entropies) / d(logits z / temperature), float32, for a block
    of columns of z (the vocabulary's ids from `first_id`). d log p(y) / d z_j = (1[j = y] - p_j) / T;
    d H / d z_j = -p_j (z_j - E_p[z]) / T, with E_p[z] = logsumexp(z) - H. `g_out` and
    `g_entropy_t` are the incoming gradients already divided by T."""
    p = (z - lse[:, None]).exp_()
    g = p * -g_out[:, None]
    if g_entropy_t is not None:
        g -= p * (z - mean_z[:, None]) * g_entropy_t[:, None]
    _scatter_target(g, target, first_id, g_out)
    return g


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, temperature, group, chunk_rows, with_entropy):
        rank, _ = _rank_and_size(group)
        vocab_local = logits.shape[-1]
        start_id = rank * vocab_local
        n = logits.shape[0]
        logprobs = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(logprobs)
        entropy = torch.empty_like(logprobs) if with_entropy else None
        for begin in range(0, n, chunk_rows):
            rows = slice(begin, min(begin + chunk_rows, n))
            z = logits[rows].float() / temperature
            row_max = _all_reduce(z.max(-1).values, dist.ReduceOp.MAX, group)
            exp = (z - row_max[:, None]).exp_()
            sum_exp = _all_reduce(exp.sum(-1), dist.ReduceOp.SUM, group)
            lse[rows] = row_max + sum_exp.log()
            target_logit = _target_logit(z, target[rows], start_id)
            logprobs[rows] = _all_reduce(target_logit, dist.ReduceOp.SUM, group) - lse[rows]
            if with_entropy:  # H = logsumexp(z) - sum_j p_j z_j
                p_dot_z = _all_reduce((exp * z).sum(-1), dist.ReduceOp.SUM, group) / sum_exp
                entropy[rows] = lse[rows] - p_dot_z
        ctx.save_for_backward(logits, target, lse, entropy if with_entropy else lse)
        ctx.temperature, ctx.group, ctx.chunk_rows, ctx.start_id = temperature, group, chunk_rows, start_id
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, target, lse, entropy = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for begin in range(0, logits.shape[0], ctx.chunk_rows):
            rows = slice(begin, min(begin + ctx.chunk_rows, logits.shape[0]))
            g_entropy_t = None if grad_entropy is None else grad_entropy[rows].float() / ctx.temperature
            z = logits[rows].float() / ctx.temperature
            g = _logits_grad(z, lse[rows], lse[rows] - entropy[rows], target[rows], ctx.start_id,
                             grad_logprobs[rows].float() / ctx.temperature, g_entropy_t)
            grad[rows] = g.to(grad.dtype)
        return grad, None, None, None, None, None


@dataclass(frozen=True)
class LinearLogits:
    """The logits hidden @ weight.T, held as their two factors and never multiplied out whole:
    `hidden` [..., h] (the output layer's input, every token this rank scores) and `weight`
    [V_local, h] (the output layer's weight: this rank's slice of the vocabulary under tensor
    parallelism). `token_logprobs` takes it in place of logits. The gradient it gives `hidden`
    is this rank's vocabulary share: the caller sums it over the tensor-parallel group, as the
    output layer's own input mapping does (gspo_mcore.megatron.qwen3_moe.forward.linear_logits)."""

    hidden: torch.Tensor
    weight: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.hidden.shape[:-1], self.weight.shape[0]))


def _accumulate_matmul(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """total (float32) += a @ b for a, b in the weight's dtype, accumulated in float32 across calls
    (one rounding at the end, as one GEMM over the whole vocabulary would round once). CUDA:
    torch.mm's out_dtype (torch 2.13 aten::mm.dtype: float32 out of float16/bfloat16 inputs, a
    CUDA kernel only; its meta function accepts the call); CPU: a float32 GEMM of the same 16-bit
    values."""
    if a.dtype == total.dtype:
        total.addmm_(a, b)
    elif a.is_cuda:
        total.add_(torch.mm(a, b, out_dtype=torch.float32))
    else:
        total.addmm_(a.float(), b.float())


class _FusedLinearLogprobs(torch.autograd.Function):
    """Log-probs (and entropy) of hidden @ weight.T / T, a block of `block` vocabulary columns at a
    time, the same blocks forward and backward: each block's logits [N, block] come from a GEMM
    of the same shapes both times (so the backward's p sums to 1 in 16-bit dtypes too), are
    rounded to the weight's dtype as the output layer's are, then taken in float32. The forward
    keeps per token a running max and sums of exponentials (and of exp x (z - max) for the
    entropy), rescaled when the max grows, and reduces them over the tensor-parallel group once
    at the end; the target's logit is kept by the block that holds it. Memory beside the saved
    hidden states: the blocks' float32 temporaries (~22 bytes a logit of a block) and, in
    backward, the hidden states' float32 gradient; never [N, V_local]."""

    @staticmethod
    def forward(ctx, hidden, weight, target, temperature, group, block, with_entropy):
        rank, _ = _rank_and_size(group)
        vocab_local, n = weight.shape[0], hidden.shape[0]
        start_id = rank * vocab_local
        running_max = torch.full((n,), -torch.inf, dtype=torch.float32, device=hidden.device)
        sum_exp = torch.zeros_like(running_max)
        # sum_j exp(z_j - max)(z_j - max): the entropy's term about the running max, not about 0
        # (H = logsumexp(z) - E_p[z] then cancels two figures of order the max, not of logsumexp).
        sum_exp_shifted = torch.zeros_like(running_max) if with_entropy else None
        target_logit = torch.zeros_like(running_max)
        for first in range(0, vocab_local, block):
            z = (hidden @ weight[first:first + block].t()).float() / temperature
            new_max = torch.maximum(running_max, z.max(-1).values)
            rescale = (running_max - new_max).exp_()
            shifted = z - new_max[:, None]
            exp = shifted.exp()
            if with_entropy:  # sum exp(z - m)(z - m) brought to the new max m' : x rescale, - (m' - m) x sum
                grown = torch.where(rescale > 0, new_max - running_max, 0.0)
                sum_exp_shifted.sub_(grown * sum_exp).mul_(rescale).add_((exp * shifted).sum(-1))
            sum_exp.mul_(rescale).add_(exp.sum(-1))
            running_max = new_max
            target_logit += _target_logit(z, target, start_id + first)
        # Over the group: the global max, then each rank's sums brought to it.
        row_max = _all_reduce(running_max.clone(), dist.ReduceOp.MAX, group)
        to_global = (running_max - row_max).exp_()
        total_exp = _all_reduce(sum_exp * to_global, dist.ReduceOp.SUM, group)
        lse = row_max + total_exp.log()
        logprobs = _all_reduce(target_logit, dist.ReduceOp.SUM, group) - lse
        entropy = None
        if with_entropy:  # H = logsumexp(z) - E_p[z] = log(sum exp(z - M)) - E_p[z - M]
            local = (sum_exp_shifted - (row_max - running_max) * sum_exp) * to_global
            entropy = total_exp.log() - _all_reduce(local, dist.ReduceOp.SUM, group) / total_exp
        ctx.save_for_backward(hidden, weight, target, lse, entropy if with_entropy else lse)
        ctx.temperature, ctx.block, ctx.start_id = temperature, block, start_id
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, target, lse, entropy = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g_out = grad_logprobs.float() / ctx.temperature
        g_entropy_t = None if grad_entropy is None else grad_entropy.float() / ctx.temperature
        mean_z = lse - entropy
        # The hidden states' gradient sums over every block: in float32, rounded once at the end.
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if want_hidden else None
        grad_weight = torch.empty_like(weight) if want_weight else None
        for first in range(0, weight.shape[0], ctx.block):
            w = weight[first:first + ctx.block]
            z = (hidden @ w.t()).float() / ctx.temperature
            g = _logits_grad(z, lse, mean_z, target, ctx.start_id + first, g_out, g_entropy_t)
            del z
            g = g.to(weight.dtype)  # as the output layer's backward takes the logits' gradient
            if want_weight:
                torch.mm(g.t(), hidden, out=grad_weight[first:first + ctx.block])
            if want_hidden:
                _accumulate_matmul(grad_hidden, g, w)
        if want_hidden:
            grad_hidden = grad_hidden.to(hidden.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def token_logprobs(
    logits: torch.Tensor | LinearLogits,
    target: torch.Tensor,
    *,
    temperature: float = 1.0,
    group=None,
    with_entropy: bool = False,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / temperature)[target] for logits [..., V_local] (this rank's
    vocabulary slice when `group` is the tensor-parallel group) and target [...] global ids.
    Returns (log-probs float32 [...], entropy float32 [...] or None), both differentiable.
    The engine's log-probs use the same temperature, so the ratio compares like with like.
    `logits` a `LinearLogits`: the same figures and gradients, the logits computed a block of
    vocabulary columns at a time (`chunk_elements` logits a block) and never held whole."""
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {list(logits.shape)} and target {list(target.shape)} do not match")
    lead = target.shape
    if isinstance(logits, LinearLogits):
        hidden, weight = logits.hidden, logits.weight
        if hidden.shape[-1] != weight.shape[1] or hidden.dtype != weight.dtype:
            raise ValueError(f"hidden states {list(hidden.shape)} {hidden.dtype} do not fit the output weight "
                             f"{list(weight.shape)} {weight.dtype}")
        flat_target = target.reshape(-1)
        block = max(1, chunk_elements // max(1, flat_target.numel()))
        logprobs, entropy = _FusedLinearLogprobs.apply(
            hidden.reshape(-1, hidden.shape[-1]), weight, flat_target, float(temperature), group, block, with_entropy)
    else:
        flat_logits = logits.reshape(-1, logits.shape[-1])
        chunk_rows = max(1, chunk_elements // logits.shape[-1])
        logprobs, entropy = _VocabParallelLogprobs.apply(
            flat_logits, target.reshape(-1), float(temperature), group, chunk_rows, with_entropy
        )
    return logprobs.reshape(lead), None if entropy is None else entropy.reshape(lead)
