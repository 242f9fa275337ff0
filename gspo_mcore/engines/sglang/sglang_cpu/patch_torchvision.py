"""Make the CUDA torchvision 0.28.0 wheel importable beside CPU torch 2.13.0 (for SGLang).

Its `__init__` imports `_meta_registrations`, which registers fakes for C ops that fail to
load here ("operator torchvision::nms does not exist"). The patch imports those modules
only when `torchvision.extension._has_ops()`. Idempotent; refuses any other version.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

VERSION = "0.28.0"
ORIGINAL = """from torchvision import (
    _autograd_registrations,
    _meta_registrations,
    datasets,"""
PATCHED = """if extension._has_ops():  # gspo-mcore CPU patch: the C ops of this wheel need CUDA torch
    from torchvision import _autograd_registrations, _meta_registrations  # noqa: F401
from torchvision import (
    datasets,"""


def main() -> int:
    spec = importlib.util.find_spec("torchvision")
    if spec is None:
        print("torchvision is not installed", file=sys.stderr)
        return 1
    root = Path(spec.origin).parent
    version = (root / "version.py").read_text()
    if f"__version__ = '{VERSION}" not in version and f'__version__ = "{VERSION}' not in version:
        print(f"torchvision at {root} is not {VERSION}; not patching", file=sys.stderr)
        return 1
    init = root / "__init__.py"
    text = init.read_text()
    if PATCHED in text:
        return 0
    if ORIGINAL not in text:
        print(f"{init}: unexpected content; not patching", file=sys.stderr)
        return 1
    init.write_text(text.replace(ORIGINAL, PATCHED, 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
