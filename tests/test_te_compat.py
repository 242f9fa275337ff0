"""megatron-core 0.16.1 without Transformer Engine (gspo_mcore.megatron.te_compat): the MoE router's gating
linear, which read an unbound `te_general_gemm` on every CUDA run without TE (issue 45 G2), runs its torch
path once the names are bound; every model build binds them; the list of what is left unbound is pinned
against the installed source."""

import ast
import inspect

import pytest
import torch
import torch.nn.functional as F
import megatron.core.utils as mcore_utils
from megatron.core.transformer.moe import moe_utils

from gspo_mcore.megatron.qwen3_moe import model as qwen3_moe_model
from gspo_mcore.megatron.te_compat import bind_missing_transformer_engine


@pytest.fixture
def without_transformer_engine(monkeypatch):
    """megatron-core as a fresh process without TE leaves it (the CPU bridge, if a test installed it, bound the
    names already): unbound gemm, no TE version."""
    if moe_utils.HAVE_TE:
        pytest.skip("Transformer Engine is installed here")
    monkeypatch.delattr(moe_utils, "te_general_gemm", raising=False)
    monkeypatch.setattr(mcore_utils, "_te_version", None)


def test_the_router_gating_linear_runs_in_float32_once_bound(without_transformer_engine):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randn(5, 3, 16, generator=g, device="cpu", requires_grad=True)
    weight = torch.randn(8, 16, generator=g, device="cpu", requires_grad=True)
    with pytest.raises(NameError, match="te_general_gemm"):  # what every TE-less CUDA run died of
        moe_utils.router_gating_linear(tokens, weight, None, torch.float32)

    bind_missing_transformer_engine()
    logits = moe_utils.router_gating_linear(tokens, weight, None, torch.float32)
    assert logits.dtype == torch.float32 and logits.shape == (5, 3, 8)
    torch.testing.assert_close(logits, F.linear(tokens, weight), atol=0, rtol=0)
    logits.square().sum().backward()
    want = [t.grad.clone() for t in (tokens, weight)]
    tokens.grad = weight.grad = None
    F.linear(tokens, weight).square().sum().backward()
    for got, expected in zip(want, (tokens.grad, weight.grad)):
        torch.testing.assert_close(got, expected)


def test_the_precision_aware_check_reads_a_version(without_transformer_engine):
    """OptimizerConfig.__post_init__ asks is_te_min_version for the host-offloaded (precision-aware) optimizer:
    None >= Version raised TypeError without TE; version 0 says no TE feature applies."""
    with pytest.raises(TypeError):
        mcore_utils.is_te_min_version("2.1.0")
    bind_missing_transformer_engine()
    assert mcore_utils.is_te_min_version("2.1.0") is False
    bind_missing_transformer_engine()  # idempotent
    assert moe_utils.te_general_gemm is None


def test_every_model_build_binds_first(monkeypatch):
    """build_model (the learner's, the reference's, parity's, the converter's verify) binds before it reads
    anything."""
    class Bound(Exception):
        pass

    def bind():
        raise Bound

    monkeypatch.setattr(qwen3_moe_model, "bind_missing_transformer_engine", bind)
    with pytest.raises(Bound):
        qwen3_moe_model.build_model(None, None, None)


def _left_unbound_without_te(module) -> set[str]:
    """Names bound inside the module's `try: import transformer_engine` blocks and nowhere else at top level."""
    tree = ast.parse(inspect.getsource(module))
    tries = [n for n in tree.body if isinstance(n, ast.Try) and "transformer_engine" in ast.unparse(n.body[0])]

    def bound(nodes):
        names = set()
        for node in (s for n in nodes for s in ast.walk(n)):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names |= {(a.asname or a.name).split(".")[0] for a in node.names}
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
        return names

    elsewhere = bound([n for n in tree.body if n not in tries])
    return set().union(*(bound(t.body) - bound(t.handlers) for t in tries)) - elsewhere


def test_what_moe_utils_leaves_unbound_is_what_te_compat_reasons_about():
    """te_compat's docstring reads each of these in megatron-core 0.16.1's source; a new megatron-core that
    leaves another name unbound must be read again (this fails)."""
    fused = {"fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_permute", "fused_permute_with_probs",
             "fused_sort_chunks_by_index", "fused_sort_chunks_by_index_with_probs", "fused_topk_with_score_function",
             "fused_unpermute"}
    assert _left_unbound_without_te(moe_utils) == {"te", "te_general_gemm"} | fused
    source = inspect.getsource(moe_utils)
    for name in fused:  # each read guarded by HAVE_TE first: never reached without TE
        reads = source.count(f"{name}(")
        assert reads == source.count(f"if not HAVE_TE or {name} is None:"), name
