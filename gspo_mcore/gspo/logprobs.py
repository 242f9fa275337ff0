"""Token log-probs (and entropy) from vocabulary-parallel logits, without gathering the vocabulary.

Under tensor parallelism each rank holds logits for a contiguous slice of the vocabulary.
log p(y) = z_y - logsumexp(z) needs only three all-reduces of per-row scalars (max, sum of
exponentials, the target's logit). Rows are processed in chunks so that the float32
temporaries stay small: the only tensor of logits size that this adds is the gradient.
"""

from __future__ import annotations

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
            t = target[rows] - start_id
            here = (t >= 0) & (t < vocab_local)
            target_logit = z.gather(1, t.clamp(0, vocab_local - 1)[:, None])[:, 0] * here
            logprobs[rows] = _all_reduce(target_logit, dist.ReduceOp.SUM, group) - lse[rows]
            if with_entropy:  # H = logsumexp(z) - sum_j p_j z_j
                p_dot_z = _all_reduce((exp * z).sum(-1), dist.ReduceOp.SUM, group) / sum_exp
                entropy[rows] = lse[rows] - p_dot_z
        ctx.save_for_backward(logits, target, lse, entropy if with_entropy else lse)
        ctx.temperature, ctx.group, ctx.chunk_rows, ctx.start_id = temperature, group, chunk_rows, start_id
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        # d log p(y) / d z_j = (1[j = y] - p_j) / temperature, on this rank's vocabulary slice;
        # d H / d z_j = -p_j (z_j - E_p[z]) / temperature, with E_p[z] = logsumexp(z) - H.
        logits, target, lse, entropy = ctx.saved_tensors
        vocab_local = logits.shape[-1]
        grad = torch.empty_like(logits)
        for begin in range(0, logits.shape[0], ctx.chunk_rows):
            rows = slice(begin, min(begin + ctx.chunk_rows, logits.shape[0]))
            g_out = grad_logprobs[rows].float() / ctx.temperature
            z = logits[rows].float() / ctx.temperature
            p = (z - lse[rows, None]).exp_()
            g = p * -g_out[:, None]
            if grad_entropy is not None:
                mean_z = (lse[rows] - entropy[rows])[:, None]
                g -= p * (z - mean_z) * (grad_entropy[rows].float() / ctx.temperature)[:, None]
            t = target[rows] - ctx.start_id
            here = (t >= 0) & (t < vocab_local)
            g.scatter_add_(1, t.clamp(0, vocab_local - 1)[:, None], (g_out * here)[:, None])
            grad[rows] = g.to(grad.dtype)
        return grad, None, None, None, None, None


def token_logprobs(
    logits: torch.Tensor,
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
    The engine's log-probs use the same temperature, so the ratio compares like with like."""
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {list(logits.shape)} and target {list(target.shape)} do not match")
    lead = target.shape
    flat_logits = logits.reshape(-1, logits.shape[-1])
    chunk_rows = max(1, chunk_elements // logits.shape[-1])
    logprobs, entropy = _VocabParallelLogprobs.apply(
        flat_logits, target.reshape(-1), float(temperature), group, chunk_rows, with_entropy
    )
    return logprobs.reshape(lead), None if entropy is None else entropy.reshape(lead)
