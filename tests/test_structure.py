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
    neutral = ["gspo_mcore/batch/rollout.py", "gspo_mcore/batch/trajectory.py", "gspo_mcore/megatron/learner.py",
               *[str(p.relative_to(REPO)) for p in (REPO / "gspo_mcore" / "megatron" / "qwen3_moe").rglob("*.py")]]
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


def module_graph(sources, root=REPO) -> dict[str, set[str]]:
    """Module -> the project modules it imports when imported."""
    names = {_module_name(p, root): p for p in sources}
    return {n: _imports_when_imported(ast.parse(p.read_text()), set(names)) - {n} for n, p in names.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one node (Tarjan)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
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
                found.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def import_cycles(sources, root=REPO) -> list[list[str]]:
    return cycles(module_graph(sources, root))


def package_graph(sources, root=REPO) -> dict[str, set[str]]:
    """gspo_mcore's packages -> the packages their modules import (top-level modules left out:
    the public API and the entry point import anything)."""
    def package(module):
        parts = module.split(".")
        return parts[1] if len(parts) > 1 and (root / "gspo_mcore" / parts[1]).is_dir() else None

    graph: dict[str, set[str]] = {}
    for module, imports in module_graph(sources, root).items():
        if package(module):
            graph.setdefault(package(module), set()).update(filter(None, map(package, imports)))
    return {package: imports - {package} for package, imports in graph.items()}


def test_gspo_mcore_has_no_import_cycle():
    assert import_cycles(PACKAGE) == []


def test_the_cycle_check_finds_a_cycle(tmp_path):
    package = tmp_path / "gspo_mcore"
    package.mkdir()
    (package / "a.py").write_text("def f():\n    from gspo_mcore.b import g\n")
    (package / "b.py").write_text("from gspo_mcore import a\n")
    (package / "c.py").write_text("if __name__ == '__main__':\n    from gspo_mcore import a\n")
    assert import_cycles(sorted(package.glob("*.py")), root=tmp_path) == [["gspo_mcore.a", "gspo_mcore.b"]]


# ------------------------------------------------------------------ the package layout
# The architecture as packages (docs/11-code-map.md draws it). A new package is a decision: add it here and there.
PACKAGES = {
    "common": "errors, files, processes, HTTP, addresses, records, seeds, plugins, deprecation",
    "batch": "the trainer's data: Rollout, Batch, Trajectory",
    "config": "schema, validation across sections, loading, the reference page",
    "gspo": "the GSPO math: losses, advantages, log-probs, packing",
    "metrics": "the metric schema and the report",
    "megatron": "parallel state, learner, optimizer, pipeline loss, checkpoints, CPU bridge, the model",
    "engines": "the engine core, its capabilities, SGLang and vLLM",
    "weight_sync": "trainer -> engine weights",
    "rollout": "producers, the rollout source, rollout functions, the tool loop",
    "rewards": "answer checks, the code grader",
    "sandbox": "model-written code, isolated",
    "tools": "tools a rollout function calls",
    "data": "prompt datasets and their preparation",
    "tasks": "the CPU configs' tasks",
    "evaluation": "held-out evaluation, gspo-eval",
    "planner": "the memory model, costs, the plan CLI",
    "rehearsal": "the GPU step rehearsed on CPU: fake devices and world, the dispatch mode, the routing plan",
    "run": "the loop, its CLI, start-up, directory, resume policy, preemption",
}
# Below the run, each layer imports only the layers before it (a package may import one further
# down only where the pair is listed: none now).
LAYERS = [["common"], ["batch", "metrics", "sandbox"], ["gspo", "rewards"], ["config", "data", "tools"],
          ["megatron"], ["engines", "weight_sync"], ["rollout", "planner"], ["tasks", "evaluation", "rehearsal"], ["run"]]
TOP_LEVEL = {"__init__", "api", "train", "rehearse"}  # the package, the public API, the `python -m` entry points


def test_the_packages_are_the_architectures():
    found = {p.name for p in (REPO / "gspo_mcore").iterdir() if (p / "__init__.py").is_file()}
    assert found == set(PACKAGES)
    assert sorted(p for p in LAYERS for p in p) == sorted(PACKAGES)
    code_map = (REPO / "docs" / "11-code-map.md").read_text()
    assert [p for p in PACKAGES if f"gspo_mcore/{p}/" not in code_map] == []


def test_top_level_modules_are_the_api_and_the_entry_point():
    """Old paths kept for a release are rows of gspo_mcore.common.deprecation.MOVED, not files: the
    top of gspo_mcore holds only what users import or run."""
    assert sorted(p.stem for p in (REPO / "gspo_mcore").glob("*.py")) == sorted(TOP_LEVEL)


def test_packages_import_one_way_down_the_layers():
    layer = {package: i for i, names in enumerate(LAYERS) for package in names}
    graph = package_graph(PACKAGE)
    assert cycles(graph) == []
    upward = sorted(f"{a} -> {b}" for a, imports in graph.items() for b in imports if layer[b] >= layer[a])
    assert upward == []


def test_the_package_check_sees_an_upward_import(tmp_path):
    root = tmp_path
    for package in ("low", "high"):
        (root / "gspo_mcore" / package).mkdir(parents=True)
        (root / "gspo_mcore" / package / "__init__.py").write_text("")
    (root / "gspo_mcore" / "low" / "x.py").write_text("from gspo_mcore.high.y import f\n")
    (root / "gspo_mcore" / "high" / "y.py").write_text("from gspo_mcore.low import x\n")
    (root / "gspo_mcore" / "top.py").write_text("from gspo_mcore.high import y\n")
    graph = package_graph(sorted((root / "gspo_mcore").rglob("*.py")), root=root)
    assert graph == {"low": {"high"}, "high": {"low"}}
    assert cycles(graph) == [["high", "low"]]


# What a reward or tool worker process imports: the shipped tasks' reward functions and tools, the
# workers themselves. torch and transformers cost a worker 2 s of CPU at each start (every run
# starts reward.workers of them); the tasks' writers import them inside their functions.
WORKER_MODULES = ["gspo_mcore.rewards.worker", "gspo_mcore.tools.worker", "gspo_mcore.tools.python",
                  "gspo_mcore.tasks.toy", "gspo_mcore.tasks.long", "gspo_mcore.tasks.agent", "gspo_mcore.tasks.code"]


def test_a_reward_or_tool_worker_imports_neither_torch_nor_transformers():
    import subprocess
    import sys

    from helpers import environment

    script = (f"import sys\nfor m in {WORKER_MODULES!r}:\n    __import__(m)\n"
              "print(sorted(m for m in ('torch', 'transformers', 'tokenizers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=environment(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["[]"], (done.stdout, done.stderr[-2000:])


def test_megatron_is_imported_without_wandb_nor_the_compiler_and_wandb_still_imports_after():
    """megatron.core imports wandb for its inference engine's logging (~0.5 s a trainer process);
    the project hides it for that import only: the W&B sink imports it afterwards. Its fused
    functions' torch.compile imported Inductor at import (~2 s a process): not any more, and
    torch.compile is torch's again after it."""
    import subprocess
    import sys

    from helpers import environment

    script = ("import sys, torch\ncompile = torch.compile\nimport gspo_mcore.megatron.learner\n"
              "print('wandb' in sys.modules, 'torch._inductor.compile_fx' in sys.modules, torch.compile is compile)\n"
              "import wandb\nprint(wandb.__name__)")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=environment(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.split() == ["False", "False", "True", "wandb"], (
        done.stdout, done.stderr[-2000:])


def test_megatrons_fused_functions_are_compiled_at_their_first_call_with_their_options():
    import torch

    from gspo_mcore.megatron import _compile_at_first_call

    compiled = []

    def compile_now(model, **options):
        compiled.append((getattr(model, "__name__", model), options))
        return lambda *args: ("compiled", model(*args))

    lazy = _compile_at_first_call(compile_now)

    def double(x):
        return 2 * x

    decorated, with_options = lazy(double), lazy(dynamic=True)(double)
    assert compiled == [] and decorated.__name__ == "double"
    assert decorated(3) == ("compiled", 6) and decorated(4) == ("compiled", 8)
    assert with_options(1) == ("compiled", 2)
    assert compiled == [("double", {}), ("double", {"dynamic": True})]  # once each, at the first call
    layer = torch.nn.Linear(1, 1)
    lazy(layer)
    assert compiled[-1][0] is layer  # a module: compiled when asked, as torch.compile does


def test_with_the_compiler_disabled_a_fused_function_runs_as_written_and_dynamo_is_never_imported(tmp_path):
    """The CPU path sets TORCH_COMPILE_DISABLE=1 (cpu_bridge): torch.compile's result would run the
    function eagerly, but calling torch.compile imported TorchDynamo and Inductor (~2 s of CPU) at
    the first MoE routing of every CPU rank (the router's `_apply_expert_bias` is fused)."""
    import subprocess
    import sys

    from helpers import environment

    script = ("import sys, types, torch\nfrom gspo_mcore.megatron import _compile_at_first_call\n"
              "calls = []\nlazy = _compile_at_first_call(lambda model, **o: calls.append(model))\n"
              "double = lazy(lambda x: 2 * x)\nprint(double(3), double(4), calls)\n"
              "from megatron.core.transformer.moe.router import TopKRouter\n"
              "router = types.SimpleNamespace(enable_expert_bias=True, local_tokens_per_expert=torch.zeros(4))\n"
              "TopKRouter._apply_expert_bias(router, torch.eye(4, dtype=torch.bool)[[0, 2, 2]])\n"
              "print(router.local_tokens_per_expert.tolist(), 'torch._inductor' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=environment(TORCH_COMPILE_DISABLE="1"))
    assert done.returncode == 0 and done.stdout.split() == ["6", "8", "[]", "[1.0,", "0.0,", "2.0,", "0.0]",
                                                            "False"], (done.stdout, done.stderr[-2000:])


OPTIMIZER_STEPS = """
import os, sys, torch
if os.environ["TORCH_COMPILE_DISABLE"] == "1":
    from gspo_mcore.megatron import cpu_bridge
    cpu_bridge.install()
torch.manual_seed(0)
weights = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
for optimizer in (torch.optim.AdamW(weights, lr=0.1, weight_decay=0.1), torch.optim.SGD(weights, lr=0.1, momentum=0.9)):
    for step in range(3):
        optimizer.zero_grad()
        (weights[0].sum(0) * weights[1]).square().sum().backward()
        optimizer.step()
    assert torch.is_grad_enabled()
    optimizer.load_state_dict(optimizer.state_dict())
print(repr([w.tolist() for w in weights]), 'torch._dynamo' in sys.modules)
"""


def test_the_cpu_path_steps_torchs_optimizers_without_importing_dynamo_and_to_the_same_numbers():
    """torch.optim imported TorchDynamo (~1.2 s of CPU a rank) at Megatron's optimizer setup and
    first step, only to keep its functions from being compiled: with the compiler disabled
    (TORCH_COMPILE_DISABLE=1, the CPU path's default) it is not imported, and the steps are the
    same as torch's own, TorchDynamo imported (TORCH_COMPILE_DISABLE=0, without the bridge)."""
    import subprocess
    import sys

    from helpers import environment

    outputs = {}
    for disabled in ("1", "0"):
        done = subprocess.run([sys.executable, "-c", OPTIMIZER_STEPS], cwd=REPO, capture_output=True, text=True,
                              timeout=120, env=environment(TORCH_COMPILE_DISABLE=disabled))
        assert done.returncode == 0, done.stderr[-2000:]
        outputs[disabled] = done.stdout.strip().rsplit(" ", 1)
    assert outputs["1"][1] == "False" and outputs["0"][1] == "True", outputs
    assert outputs["1"][0] == outputs["0"][0]


def test_the_gpu_check_has_no_import_cycle():
    """launch/gpucheck/ (the one-GPU check's sections): children.py and context.py imported each
    other (run_child / Check); a child's body is now handed to the process starter."""
    sources = sorted((REPO / "launch" / "gpucheck").glob("*.py"))
    graph = module_graph(sources, root=REPO / "launch")
    assert "gpucheck.context" in graph["gpucheck.main"] and "gpucheck.children" in graph["gpucheck.context"]
    assert cycles(graph) == []
