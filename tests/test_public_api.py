"""gspo_mcore.api, the one import path for extension code: every name it lists loads, every
example in the docs imports from it alone, and the paths users were shown before keep working for
a release, with a warning naming the new import."""

import ast
import importlib
import json
import importlib.util
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from helpers import REPO
import gspo_mcore.api as api
from gspo_mcore.common.deprecation import MOVED, REMOVED_AFTER, MovedWarning, new_home
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
# Every module path and `python -m` command README.md, docs/ and configs/ ever showed (built from
# `git log -p -- README.md docs configs`, 2026-11-28), with a name users took from it: each still
# works, the moved ones with a warning (gspo_mcore.common.deprecation.MOVED).
SHOWN_MODULES = {
    # imported (module -> a name the pages used from it)
    "gspo_mcore.api": "policy_loss", "gspo_mcore.config": "load_config", "gspo_mcore.loss": "policy_loss",
    "gspo_mcore.gspo.loss": "kl_penalty", "gspo_mcore.advantages": "group_advantages",
    "gspo_mcore.gspo.advantages": "group_advantages", "gspo_mcore.logprobs": "token_logprobs",
    "gspo_mcore.gspo.logprobs": "token_logprobs", "gspo_mcore.learner": "Learner",
    "gspo_mcore.megatron.learner": "Learner", "gspo_mcore.optimizer": "setup_training",
    "gspo_mcore.megatron.optimizer": "setup_training", "gspo_mcore.checkpointing": "Checkpointer",
    "gspo_mcore.megatron.checkpointing": "Checkpointer", "gspo_mcore.megatron_loss": "make_loss_func",
    "gspo_mcore.megatron.pipeline_loss": "make_loss_func", "gspo_mcore.metric_schema": "SCHEMA",
    "gspo_mcore.metrics.schema": "SCHEMA", "gspo_mcore.samples": "Rollout", "gspo_mcore.batch.rollout": "Rollout",
    "gspo_mcore.trajectory": "Trajectory", "gspo_mcore.rollout.trajectory": "Trajectory",
    "gspo_mcore.seeds": "step_seed", "gspo_mcore.common.seeds": "step_seed",
    "gspo_mcore.preemption": "StopRequest", "gspo_mcore.run.preemption": "StopRequest",
    "gspo_mcore.netaddr": "address_towards", "gspo_mcore.common.netaddr": "address_towards",
    "gspo_mcore.processes": "ManagedServer", "gspo_mcore.models.qwen3_moe.hf_config": "Qwen3MoeArch",
    "gspo_mcore.megatron.qwen3_moe.hf_config": "Qwen3MoeArch", "gspo_mcore.models.qwen3_moe.tiny": "TINY_QWEN3_MOE",
    "gspo_mcore.megatron.qwen3_moe.tiny": "TINY_QWEN3_MOE", "gspo_mcore.parity": "run",
    "gspo_mcore.megatron.parity": "run", "gspo_mcore.weight_sync": "check_sync",
    "gspo_mcore.rollout.functions": "load_rollout_function", "gspo_mcore.engines.base": "Engine",
    "gspo_mcore.engines.client": "EngineClient", "gspo_mcore.engines.vllm.engine": "VLLMEngine",
    "gspo_mcore.engines.vllm.nccl": "version", "gspo_mcore.rewards.code": "code_group_reward",
    "gspo_mcore.rewards.worker": "main", "gspo_mcore.rewards.server": "classify",
    "gspo_mcore.tools.python": "python", "gspo_mcore.sandbox": "Session",
    "gspo_mcore.toy_task": "category_reward", "gspo_mcore.tasks.toy": "category_reward",
}
# run (`python -m`): each runs its module's command, the moved ones the new module's.
SHOWN_COMMANDS = ["train", "data.prepare_math", "data.prepare_code", "plan", "planner.cli", "plot", "run.plot",
                  "engines.serve", "rollout.serve", "rollout.server", "torchrun", "run.torchrun", "parity",
                  "megatron.parity", "evaluate", "evaluation.cli", "rewards.code", "config_reference",
                  "config.reference", "toy_task", "tasks.toy", "long_task", "tasks.long", "agent_task",
                  "tasks.agent", "code_task", "tasks.code"]


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


@pytest.mark.parametrize("shown", sorted(SHOWN_MODULES))
def test_every_module_path_users_were_shown_still_imports(shown):
    """A moved path warns, naming its new place and the release that drops it, and gives the new
    module's objects; a current one does not warn."""
    entry = new_home(shown)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # A moved path afresh (its warning fires at import); a current module never: a second copy
        # of it would hold other classes than the ones its importers hold.
        module = fresh_import(shown) if entry else importlib.import_module(shown)
    notes = [str(w.message) for w in caught if issubclass(w.category, MovedWarning)]
    name = SHOWN_MODULES[shown]
    if entry is None:
        assert notes == [] and getattr(module, name) is not None
        return
    home, instead = entry
    assert notes and all(f"goes in the release after {REMOVED_AFTER}" in n for n in notes), notes
    assert f"{shown} is deprecated" in notes[-1] and notes[-1].endswith(instead)
    assert getattr(module, name) is getattr(importlib.import_module(home), name)


def test_the_moved_table_covers_every_old_path_shown_and_nothing_real():
    """Each moved entry is a path users were shown, and none shadows a module that exists."""
    shown = set(SHOWN_MODULES) | {f"gspo_mcore.{c}" for c in SHOWN_COMMANDS}
    assert sorted(old for old in MOVED if not any(s == old or s.startswith(old + ".") for s in shown)) == []
    for old, (home, _) in MOVED.items():
        assert importlib.util.find_spec(home) is not None, home
        assert not (REPO / (old.replace(".", "/") + ".py")).exists(), old


@pytest.mark.parametrize("command", SHOWN_COMMANDS)
def test_every_command_users_were_shown_runs_its_module(command):
    """What `python -m` would run: the module's own code (the new one's for a moved path), which
    has a command (a `__main__` block); an old `-m` path never does nothing."""
    name = f"gspo_mcore.{command}"
    spec = importlib.util.find_spec(name)
    assert spec is not None, name
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = spec.loader.get_code(name)
    entry = new_home(name)
    home = entry[0] if entry else name
    assert code.co_filename == importlib.util.find_spec(home).origin
    assert '__name__ == "__main__"' in Path(code.co_filename).read_text(), home
    assert bool([w for w in caught if issubclass(w.category, MovedWarning)]) == (entry is not None)


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


@pytest.mark.slow  # a CLI subprocess each (~8 s)
@pytest.mark.parametrize("old", ["plan", "plot", "parity", "torchrun", "evaluate", "toy_task", "train"])
def test_a_moved_command_still_runs(old):
    """`python -m gspo_mcore.<old> --help` as users ran it: the command answers, and only the
    moved ones say where it went (gspo_mcore.train is the `-m` form of gspo-train, not moved)."""
    done = subprocess.run([sys.executable, "-m", f"gspo_mcore.{old}", "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "usage:" in done.stdout, done.stderr[-2000:]
    assert (f"gspo_mcore.{old} is deprecated" in done.stderr) == (old != "train"), done.stderr[-2000:]


@pytest.mark.slow
def test_the_old_toy_task_command_writes_the_task(tmp_path):
    """The README's task step until round 4: it wrote nothing (exit 0) and the training after it
    failed on a missing model."""
    done = subprocess.run([sys.executable, "-m", "gspo_mcore.toy_task", "--head-dim", "64", str(tmp_path / "task")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "python -m gspo_mcore.toy_task is deprecated" in done.stderr
    config = json.loads((tmp_path / "task" / "model" / "config.json").read_text())
    assert config["head_dim"] == 64 and (tmp_path / "task" / "prompts.jsonl").is_file()
