"""The sandbox's stated packages (issue 46, item 6): numpy and sympy (with mpmath) import and compute
inside, in a solution and in the Python tool, read-only, from this host's installed copies; nothing
else of any site-packages is there, not even by `sys.path.append`. Before: both import-failed (the
standard library only)."""

from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path

import pytest

from gspo_mcore.sandbox import Limits, Problem, Session, Test, judge, launch
from gspo_mcore.tools.python import python

LIMITS = Limits(cpu_s=5, wall_s=15, memory_bytes=1024**3, processes=16)
SQUARES = Problem("stdin", (Test("4\n", "30 [2, 2, 3]\n"),))


def run(program: str, limits: Limits = LIMITS):
    with Session(textwrap.dedent(program), limits=limits) as session:
        return session.run("")


def test_the_stated_packages_are_found_on_this_host():
    names = {path.name for path in launch.package_paths()}
    assert {"numpy", "numpy.libs", "sympy", "mpmath"} <= names  # numpy.libs: its vendored OpenBLAS


def test_a_solution_may_use_numpy_and_sympy():
    program = ("import numpy as np, sympy\nn = int(input())\n"
               "print(int((np.arange(1, n + 1) ** 2).sum()), [int(p) for p in sympy.factorint(12, multiple=True)])\n")
    judgement = judge(program, SQUARES, limits=LIMITS)
    assert judgement.verdicts == ["passed"], judgement.infrastructure_error


def test_numpy_runs_one_thread_within_a_small_address_space():
    """OpenBLAS starts a thread per core at import (past a test's process limit on a big node):
    held to one by THREAD_ENV; numpy's import and a matrix product fit 256 MiB of address space."""
    result = run("""
        import os, numpy as np
        a = np.ones((200, 200))
        print(len(os.listdir('/proc/self/task')), float((a @ a)[0, 0]), os.environ['OPENBLAS_NUM_THREADS'])
    """, Limits(cpu_s=5, wall_s=15, memory_bytes=256 * 1024**2, processes=4))
    assert (result.status, result.exit_code) == ("exited", 0), result.stderr
    assert result.stdout.split() == ["1", "200.0", "1"]


@pytest.mark.parametrize("package", ["torch", "transformers", "gspo_mcore", "yaml", "pytest"])
def test_nothing_else_of_the_hosts_packages_is_there(package):
    program = f"import {package}\nprint('30 [2, 2, 3]')\n"
    judgement = judge(program, SQUARES, limits=LIMITS)
    assert judgement.verdicts == ["runtime_error"], judgement.infrastructure_error


def test_the_interpreters_own_site_packages_are_empty_inside():
    """The base interpreter's site-packages (here pyenv's: pytest, IPython, ...) and Debian's
    dist-packages are under bound trees: masked, so `sys.path.append` reaches nothing."""
    result = run("""
        import glob, os, sysconfig
        dirs = {sysconfig.get_paths()['purelib']} | set(glob.glob('/usr/lib/python3*/*-packages'))
        print(sorted(name for d in dirs if os.path.isdir(d) for name in os.listdir(d)))
    """)
    assert result.stdout.strip() == "[]", result.stderr


def test_the_packages_are_read_only_inside():
    result = run("""
        import numpy, os
        for path in (os.path.join(os.path.dirname(numpy.__file__), 'x'), '/sandbox/packages/x'):
            try:
                open(path, 'w')
                print('written', path)
            except OSError:
                pass
        print('done')
    """)
    assert result.stdout.strip() == "done", result.stderr


def test_the_python_tool_has_them_too():
    answer = python("import numpy as np, sympy\nx = sympy.Symbol('x')\n"
                    "print(sympy.integrate(x**2, (x, 0, 3)), round(np.linalg.det(np.eye(3) * 2)))")
    assert answer.strip() == "9 8", answer


def test_the_stated_packages_are_byte_compiled():
    """A program imports them read-only, so it cannot write their bytecode: without it each program
    compiled numpy and sympy at its import (+2.6 s of its CPU limit). `make` installs without
    byte-compiling (pip --no-compile) and compiles these; every module has its bytecode."""
    sources = [source for top in launch.package_paths() for source in ([top] if top.is_file() else top.rglob("*.py"))]
    missing = [str(source) for source in sources
               if source.suffix == ".py" and not Path(importlib.util.cache_from_source(source)).is_file()]
    assert not missing, f"{len(missing)} modules without bytecode, e.g. {missing[:3]}"
