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
