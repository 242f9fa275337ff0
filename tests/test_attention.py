"""The `local` spec's core attention (gspo_mcore.megatron.qwen3_moe.attention): torch SDPA computing what
megatron-core 0.16.1's DotProductAttention computes, in its layout, forward and gradients, in float32 on CPU;
on CUDA the math fallback (O(s^2) memory) is never among the kernels SDPA may choose."""

import contextlib
import types

import pytest
import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig
from torch.nn.attention import SDPBackend

from gspo_mcore.common.errors import InputError
from gspo_mcore.megatron.qwen3_moe import attention
from gspo_mcore.megatron.qwen3_moe.attention import ScaledDotProductAttention, cuda_kernels, kernel_scope

ONE_TP_RANK = types.SimpleNamespace(tp=types.SimpleNamespace(size=lambda: 1))


class _HostBuffer:
    """parallel_state's global memory buffer, on the host (Megatron's allocates on the current CUDA device)."""

    def get_tensor(self, shape, dtype, name):
        return torch.empty(shape, dtype=dtype, device="cpu")


@pytest.fixture
def megatron_on_host(monkeypatch):
    """What DotProductAttention needs from a CUDA process, on the host: its scores buffer and an RNG tracker
    (it forks the tracker even at dropout 0)."""
    monkeypatch.setattr(parallel_state, "get_global_memory_buffer", lambda: _HostBuffer())
    monkeypatch.setattr(tensor_parallel, "get_cuda_rng_tracker",
                        lambda: types.SimpleNamespace(fork=contextlib.nullcontext))


def _config(heads, groups, head_dim, **extra):
    return TransformerConfig(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                             num_query_groups=groups, kv_channels=head_dim, attention_dropout=0.0,
                             use_cpu_initialization=True, **extra)


def _pair(config, **kwargs):
    args = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
                pg_collection=ONE_TP_RANK, **kwargs)
    return DotProductAttention(**args), ScaledDotProductAttention(**args)


def _inputs(sq, b, heads, groups, head_dim, seed):
    g = torch.Generator().manual_seed(seed)
    make = lambda n: torch.randn(sq, b, n, head_dim, generator=g, device="cpu", requires_grad=True)  # noqa: E731
    return make(heads), make(groups), make(groups)


def _forward_and_grads(module, inputs, mask, **kwargs):
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    out = module(*inputs, mask, **kwargs)
    out.backward(torch.cos(torch.arange(out.numel(), device="cpu", dtype=out.dtype)).view_as(out))
    return out.detach(), [t.grad for t in inputs]


def _causal(sq):
    """Megatron's causal mask (transformer/utils.py get_default_causal_mask), True = masked out, on the host."""
    return torch.triu(torch.ones(sq, sq, device="cpu"), diagonal=1).bool()


# (sq, b, heads, query groups, head dim): GQA, multi-query, plain multi-head, one token, Qwen3's head_dim != h/n.
SHAPES = [(16, 2, 4, 2, 32), (7, 3, 4, 1, 8), (33, 1, 2, 2, 16), (1, 2, 4, 2, 8), (24, 2, 8, 2, 24)]


@pytest.mark.parametrize("sq,b,heads,groups,head_dim", SHAPES)
def test_causal_attention_is_megatrons(megatron_on_host, sq, b, heads, groups, head_dim):
    megatron, ours = _pair(_config(heads, groups, head_dim))
    inputs = _inputs(sq, b, heads, groups, head_dim, seed=sq)
    # Megatron's torch softmax path builds this mask itself with device="cuda": handed over here instead.
    want, want_grads = _forward_and_grads(megatron, inputs, _causal(sq) if sq > 1 else None)
    got, got_grads = _forward_and_grads(ours, inputs, None)  # causal from the mask type, as the model calls it
    assert got.shape == (sq, b, heads * head_dim)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    for name, g, w in zip("qkv", got_grads, want_grads):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5, msg=name)


def test_a_given_mask_and_the_scale_are_megatrons(megatron_on_host):
    """A boolean mask (True = masked out) replaces the causal one, as in Megatron's torch softmax path; the
    scale is config.softmax_scale when set, and apply_query_key_layer_scaling leaves the net scale alone."""
    config = _config(4, 2, 16, softmax_scale=0.3, apply_query_key_layer_scaling=True, fp16=False)
    megatron, ours = _pair(config, softmax_scale=0.3)
    sq, b = 12, 2
    padding = torch.zeros(b, 1, sq, sq, dtype=torch.bool, device="cpu")
    padding[1, ..., 9:] = True  # the second sequence's last three keys are padding
    mask = padding | _causal(sq)
    inputs = _inputs(sq, b, 4, 2, 16, seed=5)
    want, want_grads = _forward_and_grads(megatron, inputs, mask)
    got, got_grads = _forward_and_grads(ours, inputs, mask)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5)


def test_dropout_only_in_training(megatron_on_host):
    _, ours = _pair(_config(4, 2, 8), attention_dropout=0.5)
    inputs = [t.detach() for t in _inputs(10, 2, 4, 2, 8, seed=1)]
    _, plain = _pair(_config(4, 2, 8))
    ours.eval()
    assert torch.equal(ours(*inputs, None), plain(*inputs, None))
    ours.train()
    assert not torch.allclose(ours(*inputs, None), plain(*inputs, None))


def test_what_it_cannot_do_is_refused_in_one_line(megatron_on_host):
    _, ours = _pair(_config(4, 2, 8))
    q, k, v = (t.detach() for t in _inputs(6, 1, 4, 2, 8, seed=2))
    with pytest.raises(InputError, match="packed sequences"):
        ours(q, k, v, None, packed_seq_params=object())
    with pytest.raises(InputError, match="attention bias"):
        ours(q, k, v, None, attention_bias=torch.zeros(1, device="cpu"))
    with pytest.raises(InputError, match="must be boolean"):
        ours(q, k, v, torch.zeros(6, 6, device="cpu"))
    with pytest.raises(InputError, match="softmax_type 'off-by-one'"):
        ScaledDotProductAttention(config=_config(4, 2, 8, softmax_type="off-by-one"), layer_number=1,
                                  attn_mask_type=AttnMaskType.causal, attention_type="self", pg_collection=ONE_TP_RANK)


def test_on_cuda_the_math_fallback_is_never_a_choice():
    kernels = cuda_kernels(torch.device("cuda", 0))
    assert SDPBackend.MATH not in kernels
    assert set(kernels) == {SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION}
    assert cuda_kernels(torch.device("cpu")) is None  # on the host, torch chooses
    # The scope sets torch's process-wide switches (readable without a GPU), and gives them back after.
    with kernel_scope(torch.device("cuda", 0)):
        assert not torch.backends.cuda.math_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
        assert torch.backends.cuda.cudnn_sdp_enabled()
    assert torch.backends.cuda.math_sdp_enabled()
    with kernel_scope(torch.device("cpu")):
        assert torch.backends.cuda.math_sdp_enabled()


def test_every_call_runs_in_the_scope_of_its_tensors_device(megatron_on_host, monkeypatch):
    seen = []

    def recording_scope(device):
        seen.append(device)
        return contextlib.nullcontext()

    monkeypatch.setattr(attention, "kernel_scope", recording_scope)
    _, ours = _pair(_config(4, 2, 8))
    ours(*(t.detach() for t in _inputs(6, 1, 4, 2, 8, seed=3)), None)
    assert seen == [torch.device("cpu")]
