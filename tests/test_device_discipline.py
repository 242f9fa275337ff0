"""Device discipline on the model's path, checked by reading the source: no GPU runs here, and a
tensor made on the host among GPU tensors fails only on a GPU ("Expected all tensors to be on
the same device": `clip_band_high`'s `torch.full((), ...)` would have stopped every GPU run at
its first optimizer step). In the modules that run on the model's device, every torch tensor
factory names its device, or its line carries a `# host` comment saying why it stays there."""

import ast

import pytest

from helpers import REPO

FACTORIES = {"full", "zeros", "ones", "empty", "tensor", "arange", "as_tensor", "randn", "rand", "randint",
             "randperm", "linspace", "eye", "from_numpy", "empty_strided"}
ON_DEVICE = ["gspo_mcore/gspo/loss.py", "gspo_mcore/megatron/pipeline_loss.py", "gspo_mcore/metrics/report.py", "gspo_mcore/megatron/learner.py",
             "gspo_mcore/gspo/logprobs.py", "gspo_mcore/megatron/optimizer.py", "gspo_mcore/megatron/qwen3_moe/forward.py",
             "gspo_mcore/megatron/qwen3_moe/routing.py", "gspo_mcore/megatron/qwen3_moe/experts.py",
             *sorted(str(p.relative_to(REPO)) for p in (REPO / "gspo_mcore/weight_sync").glob("*.py"))]


def undisciplined(source: str) -> list[tuple[int, str]]:
    """(line, code) of each torch factory call without `device=` and without `# host` on its lines."""
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in FACTORIES
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                and not any(k.arg == "device" for k in node.keywords)
                and not any("# host" in line for line in lines[node.lineno - 1:node.end_lineno])):
            found.append((node.lineno, lines[node.lineno - 1].strip()))
    return found


@pytest.mark.parametrize("module", ON_DEVICE)
def test_every_tensor_factory_names_its_device_or_says_host(module):
    assert undisciplined((REPO / module).read_text()) == []


def test_the_check_finds_the_bug_it_is_for():
    bug = 'metrics["clip_band_high"] = torch.full((), clip_high, dtype=torch.float64)\n'
    assert undisciplined(bug) == [(1, bug.strip())]
    assert undisciplined("x = torch.full((), 1.0, device=logits.device)\n") == []
    assert undisciplined("order = torch.randperm(n)  # host: an index order for Python lists\n") == []
