"""The tokenizer of a model directory: what `AutoTokenizer.from_pretrained` gives, without its import
where its answer is known from the directory's files."""

from __future__ import annotations

import json
from pathlib import Path

# Model types whose tokenizer_config.json naming the generic backend gets that backend from
# AutoTokenizer (transformers 5.x, models/auto/tokenization_auto.py: the named class is kept unless
# the type is in its MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS; tests/test_tokenizer.py checks both).
GENERIC_BACKEND_KEPT = frozenset({"qwen3_moe"})


def load_tokenizer(path: str | Path):
    """`AutoTokenizer.from_pretrained(path)`. Importing AutoTokenizer costs ~2.7 s of CPU (its model
    registry, and TorchDynamo through transformers.masking_utils) against ~1 s for the tokenizer
    classes: a trainer's rank 0 paid it at every start. Where the directory names the generic
    backend (TokenizersBackend: tokenizer.json as written, what this project's task writers save)
    for a model type that keeps it, that class loads it directly; anything else goes through
    AutoTokenizer."""
    if _generic_backend(Path(path)):
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _generic_backend(path: Path) -> bool:
    try:
        tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return False
    return (isinstance(tokenizer_config, dict) and tokenizer_config.get("tokenizer_class") == "TokenizersBackend"
            and "auto_map" not in tokenizer_config and model_type in GENERIC_BACKEND_KEPT)
