import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gspo_mcore.gspo.logprobs import LinearLogits, token_logprobs


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_elements", [1 << 24, 37])  # one chunk; many ragged chunks
def test_matches_log_softmax_values_and_gradients(temperature, chunk_elements):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 5, 50, generator=g, dtype=torch.float64) * 3).requires_grad_(True)
    target = torch.randint(0, 50, (3, 5), generator=g)
    weights = torch.randn(3, 5, generator=g, dtype=torch.float64)
    ours, entropy = token_logprobs(logits.float(), target, temperature=temperature, with_entropy=True,
                                   chunk_elements=chunk_elements)
    log_p = (logits / temperature).log_softmax(-1)
    ref = log_p.gather(-1, target[..., None])[..., 0]
    ref_entropy = -(log_p.exp() * log_p).sum(-1)
    assert torch.allclose(ours.double(), ref, atol=1e-5)
    assert torch.allclose(entropy.double(), ref_entropy, atol=1e-5)
    (g_ours,) = torch.autograd.grad((ours.double() * weights).sum(), logits, retain_graph=True)
    (g_ref,) = torch.autograd.grad((ref * weights).sum(), logits, retain_graph=True)
    assert torch.allclose(g_ours, g_ref, atol=1e-5)
    # The entropy bonus (loss.entropy_coef) differentiates the entropy, alone and with the log-probs.
    entropy_weights = torch.randn(3, 5, generator=g, dtype=torch.float64)
    (g_ours,) = torch.autograd.grad((entropy.double() * entropy_weights).sum(), logits, retain_graph=True)
    (g_ref,) = torch.autograd.grad((ref_entropy * entropy_weights).sum(), logits, retain_graph=True)
    assert g_ref.abs().max() > 1e-3 and torch.allclose(g_ours, g_ref, atol=1e-5)
    (g_ours,) = torch.autograd.grad((ours.double() * weights + entropy.double() * entropy_weights).sum(), logits)
    (g_ref,) = torch.autograd.grad((ref * weights + ref_entropy * entropy_weights).sum(), logits)
    assert torch.allclose(g_ours, g_ref, atol=1e-5)


def test_shape_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match=r"logits \[2, 3, 10\] and target \[2, 4\]"):
        token_logprobs(torch.zeros(2, 3, 10), torch.zeros(2, 4, dtype=torch.long))


# ------------------------------------------------------------------ fused linear log-probs


def _three_paths(temperature, chunk_elements, with_entropy=True, seed=0):
    """Log-probs, entropy and the gradients w.r.t. hidden and weight from the logits path
    (hidden @ weight.T, then token_logprobs) and from LinearLogits in float32, and from
    log_softmax in float64."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(3, 7, 16, generator=g, dtype=torch.float64)
    weight = torch.randn(50, 16, generator=g, dtype=torch.float64) * 0.4  # logits of std ~1.6, as a model's
    target = torch.randint(0, 50, (3, 7), generator=g)
    weights, entropy_weights = torch.randn(3, 7, generator=g), torch.randn(3, 7, generator=g)
    results = {}
    for path in ("logits", "fused", "float64"):
        dtype = torch.float64 if path == "float64" else torch.float32
        h, w = hidden.to(dtype).requires_grad_(True), weight.to(dtype).requires_grad_(True)
        if path == "float64":
            log_p = ((h @ w.t()) / temperature).log_softmax(-1)
            logprobs = log_p.gather(-1, target[..., None])[..., 0]
            entropy = -(log_p.exp() * log_p).sum(-1) if with_entropy else None
        else:
            logits = LinearLogits(h, w) if path == "fused" else h @ w.t()
            logprobs, entropy = token_logprobs(logits, target, temperature=temperature, with_entropy=with_entropy,
                                               chunk_elements=chunk_elements)
        objective = (logprobs * weights.to(dtype)).sum()
        if with_entropy:
            objective = objective + (entropy * entropy_weights.to(dtype)).sum()
        results[path] = [logprobs, entropy, *torch.autograd.grad(objective, (h, w))]
    return results


FIGURES = ("log-probs", "entropy", "grad hidden", "grad weight")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_in_one_block_is_the_logits_path_bit_for_bit(temperature):
    """One block of the vocabulary: the same GEMM and the same float32 operations as the logits
    path (the entropy apart: the fused path sums it about the max, not about 0)."""
    paths = _three_paths(temperature, 1 << 24, with_entropy=False)
    for name, ours, theirs in zip(FIGURES, paths["fused"], paths["logits"]):
        assert (ours is None and theirs is None) or torch.equal(ours, theirs), name


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_elements", [37, 300, 1 << 24])  # 2 and 14 vocabulary columns a block, ragged; one
@pytest.mark.parametrize("with_entropy", [True, False])
def test_fused_matches_the_logits_path_in_float32(temperature, chunk_elements, with_entropy):
    """Blocks of the vocabulary (a running max rescaled, the hidden gradient summed over the
    blocks): log-probs, entropy and the gradients w.r.t. hidden and weight within 1e-6 of the
    logits path's, and within 1e-6 of float64's, relative to the figure's scale (at least 1)."""
    paths = _three_paths(temperature, chunk_elements, with_entropy)
    for name, ours, theirs, exact in zip(FIGURES, paths["fused"], paths["logits"], paths["float64"]):
        if exact is None:
            assert ours is None and theirs is None
            continue
        scale = max(1.0, exact.abs().max().item())
        assert (ours.double() - theirs.double()).abs().max().item() <= 1e-6 * scale, name
        assert (ours.double() - exact).abs().max().item() <= 1e-6 * scale, name


def test_fused_gives_no_weight_gradient_unasked_and_forward_only_needs_no_graph():
    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(4, 8, generator=g).requires_grad_(True), torch.randn(20, 8, generator=g)
    target = torch.randint(0, 20, (4,), generator=g)
    logprobs, _ = token_logprobs(LinearLogits(hidden, weight), target, chunk_elements=16)
    (grad,) = torch.autograd.grad(logprobs.sum(), hidden)
    reference = (hidden @ weight.t()).log_softmax(-1).gather(-1, target[:, None])[:, 0]
    assert torch.allclose(grad, torch.autograd.grad(reference.sum(), hidden)[0], atol=1e-6)
    with torch.no_grad():  # the reference model's and the recomputed pi_old's forward
        again, _ = token_logprobs(LinearLogits(hidden, weight), target, chunk_elements=16)
    assert not again.requires_grad and torch.allclose(again, reference, atol=1e-6)


class _LargestTensor(TorchDispatchMode):
    """The most elements any op's output had while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in torch.utils._pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.numel())
        return out


@pytest.mark.parametrize("fused", [False, True])
def test_fused_never_holds_the_logits_whole(fused):
    """Forward and backward of 64 tokens over 1000 words, 8192 logits a block: no tensor of the
    fused path reaches the 64,000 logits (the logits path holds them and their gradient)."""
    g = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(64, 16, generator=g).requires_grad_(True), torch.randn(1000, 16, generator=g)
    weight.requires_grad_(True)
    target = torch.randint(0, 1000, (64,), generator=g)
    with _LargestTensor() as seen:
        logits = LinearLogits(hidden, weight) if fused else hidden @ weight.t()
        logprobs, entropy = token_logprobs(logits, target, with_entropy=True, chunk_elements=8192)
        (logprobs.sum() + entropy.sum()).backward()
    if fused:
        assert seen.largest <= max(8192, weight.numel())  # a block, or the weight's own gradient
    else:
        assert seen.largest == 64 * 1000


def test_fused_refuses_hidden_states_that_do_not_fit_the_weight():
    with pytest.raises(ValueError, match=r"hidden states \[2, 3, 8\] torch.float32 do not fit the output weight "
                                         r"\[10, 4\] torch.float32"):
        token_logprobs(LinearLogits(torch.zeros(2, 3, 8), torch.zeros(10, 4)), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"logits \[2, 3, 10\] and target \[2, 4\]"):
        token_logprobs(LinearLogits(torch.zeros(2, 3, 4), torch.zeros(10, 4)), torch.zeros(2, 4, dtype=torch.long))
