"""The code's shape, checked by reading it: the package boundary runs one way, and no function
grows past what one screen shows."""

import ast

import pytest

from helpers import REPO

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


# ------------------------------------------------------------------ the engine boundary
ENGINE_PACKAGES = {"sglang": "gspo_mcore/engines/sglang/", "vllm": "gspo_mcore/engines/vllm/"}
# Every HTTP path the project calls on an engine's servers: only that engine's package may name one.
SGLANG_ENDPOINTS = {"/generate", "/abort_request", "/get_server_info", "/pause_generation", "/continue_generation",
                    "/begin_weight_update", "/end_weight_update", "/update_weight_version", "/flush_cache",
                    "/update_weights_from_disk", "/update_weights_from_distributed", "/update_weights_from_tensor",
                    "/init_weights_update_group", "/destroy_weights_update_group", "/release_memory_occupation",
                    "/resume_memory_occupation"}
VLLM_ENDPOINTS = {"/inference/v1/generate", "/v1/completions", "/abort_requests", "/server_info", "/pause", "/resume",
                  "/collective_rpc", "/reset_prefix_cache", "/sleep", "/wake_up", "/init_weight_transfer_engine",
                  "/start_weight_update", "/update_weights", "/finish_weight_update",
                  "/shutdown_weight_transfer_engine"}
ENDPOINTS = SGLANG_ENDPOINTS | VLLM_ENDPOINTS
PACKAGE = [p for p in SOURCES if p.parts[len(REPO.parts)] == "gspo_mcore"]


def _in_engine(path) -> str | None:
    """The engine whose package holds `path`, or None."""
    relative = str(path.relative_to(REPO))
    return next((name for name, prefix in ENGINE_PACKAGES.items() if relative.startswith(prefix)), None)


def _outside_engines(path) -> bool:
    return _in_engine(path) is None


def _names_endpoint(value: str) -> bool:
    return any(value == e or value.endswith(e) or value.split("?")[0].endswith(e) for e in ENDPOINTS)


def test_nothing_outside_an_engine_package_imports_an_engine_or_names_its_endpoints():
    offenders = []
    for path in filter(_outside_engines, PACKAGE):
        tree = ast.parse(path.read_text())
        offenders += [f"{path.relative_to(REPO)}: imports {m}" for m in imported_modules(tree)
                      if m.split(".")[0] in ("sglang", "vllm")]
        named = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
                 and _names_endpoint(node.value)}
        offenders += [f"{path.relative_to(REPO)}: names {e}" for e in sorted(named)]
    assert offenders == []


def test_no_engine_package_reaches_into_another():
    offenders = []
    for path in PACKAGE:
        engine = _in_engine(path)
        if engine is None:
            continue
        for module in imported_modules(ast.parse(path.read_text())):
            others = [name for name in ENGINE_PACKAGES if name != engine]
            if module.split(".")[0] in others or any(module.startswith(f"gspo_mcore.engines.{o}") for o in others):
                offenders.append(f"{path.relative_to(REPO)}: imports {module}")
    assert offenders == []


def test_the_structure_test_sees_an_endpoint_named_outside():
    """The check above finds what it looks for (a string it would miss is a test that cannot fail)."""
    tree = ast.parse('answer = post(f"{url}/update_weights_from_disk", body)\nfrom sglang.srt import utils\n')
    assert "sglang.srt" in imported_modules(tree)
    constants = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    assert any(c.endswith("/update_weights_from_disk") for c in constants)


def test_the_sample_types_and_models_belong_to_no_engine_and_no_rollout():
    """Rollout and Trajectory are the trainer's data: engines produce them, models and the
    learner consume them, and none of these reaches up into rollout/ or engines/."""
    neutral = ["gspo_mcore/samples.py", "gspo_mcore/trajectory.py", "gspo_mcore/learner.py",
               *[str(p.relative_to(REPO)) for p in (REPO / "gspo_mcore" / "models").rglob("*.py")]]
    offenders = [f"{name}: {m}" for name in neutral for m in imported_modules(ast.parse((REPO / name).read_text()))
                 if m.startswith(("gspo_mcore.rollout", "gspo_mcore.engines"))]
    assert offenders == []


def _module_name(path, root) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports_when_imported(tree: ast.AST, modules: set[str]) -> set[str]:
    """The project modules a module imports, at any depth, except in its `if __name__ ==
    "__main__":` block (that runs only when the module is the program, never on import)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test).replace("'", '"') == '__name__ == "__main__"':
            node.body = []  # the __main__ block
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
    return {m for m in found if m in modules}


def import_cycles(sources, root=REPO) -> list[list[str]]:
    """Strongly connected groups of more than one module in the import graph (Tarjan)."""
    names = {_module_name(p, root): p for p in sources}
    graph = {n: _imports_when_imported(ast.parse(p.read_text()), set(names)) - {n} for n, p in names.items()}
    index, low, stack, on_stack, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
                on_stack.discard(group[-1])
            if len(group) > 1:
                cycles.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return cycles


def test_gspo_mcore_has_no_import_cycle():
    assert import_cycles(PACKAGE) == []


def test_the_cycle_check_finds_a_cycle(tmp_path):
    package = tmp_path / "gspo_mcore"
    package.mkdir()
    (package / "a.py").write_text("def f():\n    from gspo_mcore.b import g\n")
    (package / "b.py").write_text("from gspo_mcore import a\n")
    (package / "c.py").write_text("if __name__ == '__main__':\n    from gspo_mcore import a\n")
    assert import_cycles(sorted(package.glob("*.py")), root=tmp_path) == [["gspo_mcore.a", "gspo_mcore.b"]]
