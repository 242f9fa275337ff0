import pytest
import torch

from gspo_mcore.gspo.logprobs import token_logprobs


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
