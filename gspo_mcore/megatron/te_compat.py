"""megatron-core 0.16.1 without Transformer Engine: the names it leaves unbound (or None) that our paths read.

A bare CUDA machine has no Transformer Engine (no wheel of `transformer-engine-torch`: it compiles against the
local torch with nvcc), and the `local` spec needs none. megatron-core 0.16.1 imports TE inside
`try: import transformer_engine` blocks and, where that fails, leaves names unbound that some paths still read.
What our model and optimizer paths read, read in the installed source:

- `transformer/moe/moe_utils.py` `RouterGatingLinearFunction.forward`/`backward` read `te_general_gemm`
  whenever the router dtype is not float64 (we set `moe_router_dtype="fp32"`): a NameError on every MoE
  forward (the first H100 run, issue 45 G2). `None` selects its `torch.mm` / `torch.addmm` branch, the one
  the float64 router takes; Megatron-LM 9ed8b0c (first in core_v0.17.0) binds it to None the same way.
  `router.py` imports only `router_gating_linear`, which reads the module global: one binding serves both.
- `utils.py` `get_te_version` returns None without TE, and `is_te_min_version` then compares None with a
  Version (TypeError): `optimizer/optimizer_config.py` `OptimizerConfig.__post_init__` does so for
  `use_precision_aware_optimizer`, which our host-offloaded optimizer sets
  (gspo_mcore.megatron.optimizer.megatron_optimizer_settings). Version "0" means "no TE feature applies",
  so the offload is Megatron's HybridDeviceOptimizer, as in the image.

Left alone on purpose: the eight `fused_*` names of the same block (`fused_permute`, `fused_unpermute`,
`fused_permute_with_probs`, `fused_sort_chunks_by_index[_with_probs]`, `fused_topk_with_score_function`,
`fused_compute_score_for_moe_aux_loss`, `fused_moe_aux_loss`). Each read sits behind
`if not HAVE_TE or <name> is None: raise ValueError(...)`, which short-circuits on HAVE_TE before the name is
read, and only under `fused=config.moe_permute_fusion` (our config sets it for the `te` spec alone) or
`fused=config.moe_router_fusion` (never set: Megatron's default False): binding them to None would select
nothing different.
tests/test_te_compat.py pins this list against the installed source.

Why megatron-core 0.16.1 and not 0.17 (which fixes the router itself): 0.17 and newer require Python >= 3.12,
and the CPU machines (CI, `.venv`) are Python 3.11, where pip resolves 0.16.1. One pin everywhere keeps one
API for the CPU tests and the GPU runs; this module is the price, and goes when the pin moves.

`bind_missing_transformer_engine()` is called by `qwen3_moe.model.build_model` (every model we build: the
learner's, the reference, parity, the converter's verify) and by the CPU bridge. It changes nothing when TE
imports.
"""

from __future__ import annotations


def _transformer_engine_imports() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def bind_missing_transformer_engine() -> None:
    """Idempotent. Bind what megatron-core 0.16.1 leaves unbound without Transformer Engine (see the module
    docstring); a no-op for each name TE (or an earlier call) bound."""
    import megatron.core.utils as mcore_utils
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        # Unbound also when TE imports but megatron.core.extensions.transformer_engine does not (an old TE):
        # the torch path is then the one that can run.
        moe_utils.te_general_gemm = None
    if mcore_utils._te_version is None and not _transformer_engine_imports():
        from packaging.version import Version

        mcore_utils._te_version = Version("0")
