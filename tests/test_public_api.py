"""gspo_mcore.api, the one import path for extension code: every name it lists loads, every
example in the docs imports from it alone, and the paths users were shown before keep working for
a release, with a warning naming the new import."""

import ast
import importlib
import re
import subprocess
import sys
import warnings

import pytest

from helpers import REPO
import gspo_mcore.api as api
from gspo_mcore.common.deprecation import MovedWarning
from gspo_mcore.common.plugins import by_name

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

# `module:function` names configs and docs have shown users (git log -p -- docs README.md configs),
# whether or not the current pages still quote them: each must keep resolving.
SHOWN_CONFIG_NAMES = {"gspo_mcore.tasks.toy:category_reward", "gspo_mcore.tools.python:python",
                      "gspo_mcore.tasks.agent:lookup", "gspo_mcore.tasks.agent:lookup_reward",
                      "gspo_mcore.tasks.code:program_rewards", "gspo_mcore.tasks.long:list_reward",
                      "gspo_mcore.rewards.code:code_group_reward",
                      # the same before the package layout (they warn)
                      "gspo_mcore.toy_task:category_reward", "gspo_mcore.agent_task:lookup",
                      "gspo_mcore.agent_task:lookup_reward", "gspo_mcore.code_task:program_rewards",
                      "gspo_mcore.long_task:list_reward"}
# Import paths that moved, with a name users imported from each and where it lives now.
# (the old path, the name, its home now, what the warning tells users to write instead)
MOVED = {"gspo_mcore.rollout.trajectory": ("Trajectory", "gspo_mcore.batch.trajectory", "from gspo_mcore.api import Trajectory"),
         "gspo_mcore.rollout.serve": ("main", "gspo_mcore.engines.serve", "python -m gspo_mcore.engines.serve"),
         # the flat modules users named in configs or ran with `python -m`, before the package layout
         **{f"gspo_mcore.{old}_task": (name, f"gspo_mcore.tasks.{old}", f"gspo_mcore.tasks.{old}")
            for old, name in [("toy", "category_reward"), ("long", "list_reward"), ("agent", "lookup"),
                              ("code", "program_rewards")]},
         **{f"gspo_mcore.{old}": ("main", f"gspo_mcore.{new}", f"python -m gspo_mcore.{new}")
            for old, new in [("plan", "planner.cli"), ("plot", "run.plot"), ("parity", "megatron.parity"),
                             ("torchrun", "run.torchrun")]},
         "gspo_mcore.evaluate": ("cli", "gspo_mcore.evaluation.cli", "gspo-eval (python -m gspo_mcore.evaluation.cli)")}


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)


def gspo_imports(code: str) -> list[tuple[str, list[str]]]:
    """(module, names) of each import of a gspo_mcore module in `code`."""
    found = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "gspo_mcore":
            found.append((node.module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names if alias.name.split(".")[0] == "gspo_mcore"]
    return found


def off_api(code: str) -> list[str]:
    """Each gspo_mcore import in `code` that is not a name of gspo_mcore.api."""
    return [f"{module}: {names}" for module, names in gspo_imports(code)
            if module != "gspo_mcore.api" or not names or not set(names) <= set(api.__all__)]


def fresh_import(module: str):
    """Import `module` as a first import would (its warning fires at import)."""
    sys.modules.pop(module, None)
    return importlib.import_module(module)


def test_every_listed_name_loads():
    for name in api.__all__:
        assert getattr(api, name) is not None, name
    assert set(api.__all__) <= set(dir(api))
    assert {"Trajectory", "Task", "EngineHandle", "Rollout", "LossInputs", "aggregate", "classify"} <= set(api.__all__)
    with pytest.raises(AttributeError, match="no attribute 'load_config'"):  # not an extension's name
        api.load_config  # noqa: B018


def test_a_reward_importing_classify_does_not_import_torch():
    """A reward worker imports only its reward: the API's names load on first use."""
    code = "import sys; from gspo_mcore.api import classify; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr[-2000:]


def test_the_import_check_flags_what_it_should():
    assert off_api("from gspo_mcore.api import Trajectory, aggregate\nimport torch") == []
    assert off_api("from gspo_mcore.gspo.loss import aggregate") == ["gspo_mcore.gspo.loss: ['aggregate']"]
    assert off_api("import gspo_mcore.batch.trajectory") == ["gspo_mcore.batch.trajectory: []"]
    assert off_api("from gspo_mcore.api import not_exported") == ["gspo_mcore.api: ['not_exported']"]
    assert python_blocks("x\n```python\na = 1\n```\n```bash\nb\n```\n") == ["a = 1\n"]


def test_every_docs_example_imports_only_from_the_api():
    importing = {}
    for path in DOCS:
        for code in python_blocks(path.read_text()):
            if gspo_imports(code):
                importing.setdefault(path.name, []).extend(off_api(code))
    # the rollout function, the reward model and both loss examples are among them
    assert {"03-multi-turn.md", "05-data-and-rewards.md", "07-loss.md"} <= set(importing)
    assert {name: bad for name, bad in importing.items() if bad} == {}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_moved_path_still_works_and_warns(old):
    name, home, instead = MOVED[old]
    with pytest.warns(DeprecationWarning, match=f"{re.escape(old)} is deprecated.*: {re.escape(instead)}$"):
        module = fresh_import(old)
    assert getattr(module, name) is getattr(importlib.import_module(home), name)


def test_a_config_name_through_a_moved_path_warns_once_at_the_users_line(tmp_path, monkeypatch):
    """A user's rollout function written against last round's import: resolving its config name
    works, warns once, and the warning points at the user's import line."""
    (tmp_path / "oldpkg").mkdir()
    (tmp_path / "oldpkg" / "__init__.py").write_text("")
    (tmp_path / "oldpkg" / "rollouts.py").write_text(
        "from gspo_mcore.rollout.trajectory import Trajectory\n\n"
        "async def ask(task, engine):\n    return Trajectory(prompt_ids=[1])\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("gspo_mcore.rollout.trajectory", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = by_name("oldpkg.rollouts:ask", {}, "rollout.function")
        again = by_name("oldpkg.rollouts:ask", {}, "rollout.function")
    moved = [w for w in caught if issubclass(w.category, MovedWarning)]
    assert first is again and first.__module__ == "oldpkg.rollouts"
    assert len(moved) == 1 and "from gspo_mcore.api import Trajectory" in str(moved[0].message)
    assert moved[0].filename == str(tmp_path / "oldpkg" / "rollouts.py") and moved[0].lineno == 1


def test_every_config_name_users_were_shown_resolves():
    quoted = set()
    for path in [*DOCS, *sorted((REPO / "configs").glob("*.yaml"))]:
        quoted |= set(re.findall(r"\bgspo_mcore(?:\.\w+)+:\w+", path.read_text()))
    assert SHOWN_CONFIG_NAMES & quoted  # the pattern finds the names the pages quote
    for name in sorted(SHOWN_CONFIG_NAMES | quoted):
        assert callable(by_name(name, {}, "reward.name")), name


@pytest.mark.parametrize("old", ["plan", "plot", "parity", "torchrun", "evaluate", "train"])
def test_a_moved_command_still_runs(old):
    """`python -m gspo_mcore.<old> --help` as users ran it: the command answers, and only the
    moved ones say where it went (gspo_mcore.train is the `-m` form of gspo-train, not moved)."""
    done = subprocess.run([sys.executable, "-m", f"gspo_mcore.{old}", "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "usage:" in done.stdout, done.stderr[-2000:]
    assert (f"gspo_mcore.{old} is deprecated" in done.stderr) == (old != "train"), done.stderr[-2000:]
