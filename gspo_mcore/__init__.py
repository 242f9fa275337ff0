"""gspo-mcore: GSPO for Qwen3-MoE on Megatron-Core, rollouts from SGLang or vLLM."""

import warnings

# Megatron-Core says at import that it runs without Apex / Transformer Engine (the CPU path and
# the local spec use neither): a dozen lines before anything useful, and nothing to act on.
# Narrow on purpose: every other warning still shows.
warnings.filterwarnings("ignore", message=r"(Transformer Engine and )?Apex (is|are) not installed", category=UserWarning)

# The import paths earlier releases showed users keep working, with a warning (common/deprecation.py).
from gspo_mcore.common import deprecation as _deprecation  # noqa: E402

_deprecation.install()
