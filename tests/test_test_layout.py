"""The test suite's own layout: what tests share lives in tests/helpers.py (and conftest's
fixtures); no test module imports another, where pytest would collect the imported module's
tests twice over and a private helper's change breaks a distant file."""

import ast

import pytest

from helpers import REPO

TESTS = sorted((REPO / "tests").glob("test_*.py"))
TEST_MODULES = {path.stem for path in TESTS}



def imported_test_modules(path) -> set[str]:
    """The test modules `path` imports, at any depth (as `test_x` or `tests.test_x`)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        found |= {name.removeprefix("tests.").split(".")[0] for name in names} & TEST_MODULES
    return found


def test_the_check_sees_imports_at_any_depth(tmp_path):
    sample = tmp_path / "test_sample.py"
    sample.write_text("import os\nfrom test_http import Handler\n\ndef f():\n    import tests.test_loss as loss\n"
                      "    from helpers import REPO\n")
    assert imported_test_modules(sample) == {"test_http", "test_loss"}


@pytest.mark.parametrize("path", TESTS, ids=lambda path: path.name)
def test_no_test_module_imports_another(path):
    assert not imported_test_modules(path), f"{path.name} imports a test module: move what it needs to tests/helpers.py"



def test_waiting_for_a_runs_rows_ends_when_they_are_written_or_the_run_exits(tmp_path):
    """helpers.wait_for_rows: returns once the rows are there, fails at once (not after its
    timeout) when the run exits first, naming the step and quoting the run's log."""
    import sys

    from helpers import reaped, start, wait_for_rows

    writer = "import sys, time\nfor step in (1, 2):\n    time.sleep(0.3)\n    open(sys.argv[1], 'a').write('{}\\n')\n"
    with reaped(start([sys.executable, "-c", writer, str(tmp_path / "metrics.jsonl")])) as run:
        wait_for_rows(run, tmp_path, 2, timeout_s=30)
    log = tmp_path / "run.log"
    with reaped(start([sys.executable, "-c", "print('gave up at step 1')"], log)) as run:
        with pytest.raises(pytest.fail.Exception, match=r"did not reach step 3 \(exit code 0\)\n.*gave up at step 1"):
            wait_for_rows(run, tmp_path, 3, log, timeout_s=30)


def test_ci_runs_the_fast_tier_then_the_rest_each_test_once():
    """`.ci/run`: `make test-fast` (a broken build fails in minutes) then `make test-slow`; the
    two run `make test`'s very command, split by the `slow` mark, so every test runs exactly once."""
    import subprocess

    def pytest_line(target: str) -> str:
        dry = subprocess.run(["make", "-n", target], cwd=REPO, capture_output=True, text=True, timeout=60)
        [line] = [line for line in dry.stdout.splitlines() if " -m pytest " in line]
        return line

    whole = pytest_line("test")
    assert whole.endswith(" tests")
    assert pytest_line("test-fast") == whole.removesuffix(" tests") + ' -m "not slow" tests'
    assert pytest_line("test-slow") == whole.removesuffix(" tests") + " -m slow tests"
    commands = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line.startswith("make ")]
    assert commands == ["make test-fast", "make test-slow"]


_NODE_ID_DUMP = """
import os, pytest

def pytest_collection_finish(session):  # on the worker, after every collection hook
    if os.environ.get("PYTEST_XDIST_WORKER"):
        with open(os.environ["NODE_ID_DUMP"], "w") as f:
            f.write("\\n".join(item.nodeid for item in session.items))

def pytest_runtest_setup(item):
    pytest.skip("collection only")
"""


def test_the_layout_tests_share_one_xdist_group_on_the_workers(tmp_path):
    """conftest puts the tests that need a layout's torchrun launch in the `layouts` group: under
    `--dist loadgroup` the workers name an item's group in its node id (`...@layouts`) in their own
    collection hook, which ran before conftest's, so these tests had no group, each worker launched
    the layouts it met again, and the `layouts` group never showed in the times per group."""
    import os
    import subprocess
    import sys

    (tmp_path / "node_id_dump.py").write_text(_NODE_ID_DUMP)
    dump = tmp_path / "node_ids.txt"
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "NODE_ID_DUMP": str(dump)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "1", "--dist", "loadgroup", "-m", "slow",
                          "-p", "node_id_dump", "-p", "no:cacheprovider", "tests/test_gspo_step.py"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    ids = dump.read_text().splitlines()
    layout_tests = [i for i in ids if "layout_invariant" in i]
    assert layout_tests and all(i.endswith("@layouts") for i in layout_tests), ids


def test_the_workers_take_the_heaviest_group_first_and_every_group_has_its_seconds():
    """tests/xdist_order.py: the heaviest group is handed out first, the ungrouped tests after the
    groups in queue order; a group named in a test module and missing there would go last."""
    import re

    from xdist_order import GROUP_SECONDS, heaviest

    queue = ["tests/test_a.py::test_one", "code_cpu", "train", "tests/test_b.py::test_two", "async_engine"]
    order = []
    while queue:
        order.append(heaviest(queue))
        queue.remove(order[-1])
    assert order == ["train", "code_cpu", "async_engine", "tests/test_a.py::test_one", "tests/test_b.py::test_two"]
    named = {m for path in (REPO / "tests").glob("*.py")
             for m in re.findall(r'xdist_group\("([a-z_0-9]+)"\)', path.read_text())}
    assert named == set(GROUP_SECONDS)
