"""The code's shape, checked by reading it: the package boundary runs one way, and no function
grows past what one screen shows."""

import ast

import pytest

from conftest import REPO

SOURCES = sorted(p for root in ("gspo_mcore", "checkpoint_convert") for p in (REPO / root).rglob("*.py")
                 if "sglang_cpu/shim" not in str(p))
MAX_FUNCTION_LINES = 60


def imported_modules(tree: ast.AST) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def test_gspo_mcore_never_imports_checkpoint_convert():
    """checkpoint_convert (the converter CLI) builds on gspo_mcore (the mapping table, the
    safetensors and torch_dist I/O), never the other way round."""
    offenders = [str(p.relative_to(REPO)) for p in SOURCES if p.parts[len(REPO.parts)] == "gspo_mcore"
                 and any(m.split(".")[0] == "checkpoint_convert" for m in imported_modules(ast.parse(p.read_text())))]
    assert offenders == []


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(REPO)))
def test_no_function_is_longer_than_a_screen(path):
    long = [f"{node.name}: {node.end_lineno - node.lineno + 1} lines" for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert long == []
