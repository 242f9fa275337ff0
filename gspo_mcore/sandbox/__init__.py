"""A sandbox for untrusted programs (a model's code): one component that the code reward
(gspo_mcore.rewards.code) and the Python tool (gspo_mcore.tools.python) both use.

- `launch`: bubblewrap's boundary (namespaces; read-only interpreter, C++ compiler and stated
  packages: numpy, sympy; private tmpfs), the per-slot non-root uid, the one-line refusal where
  bwrap (or g++) cannot run, the explicit unsafe mode;
- `seccomp`: the syscall filter;
- `cgroup`: a sandbox's memory and processes bounded as a whole, where the host allows it;
- `harness`: the code inside, one forked process per test with rlimits (a C++ program built
  first, under limits of its own);
- `session`: the host's end (a sandbox per program, started ahead as a spare; wall-clock kill of
  the whole process group, capped reports, infrastructure errors as `SandboxError`);
- `judge`: comparison on the host (expected outputs never enter the sandbox) and verdicts.
docs/13-code-rl.md has the threat model."""

from gspo_mcore.sandbox.judge import VERDICTS, Judgement, Problem, Test, judge
from gspo_mcore.sandbox.launch import UNSAFE_VARIABLE, SandboxSettings, SandboxUnavailable
from gspo_mcore.sandbox.session import LANGUAGES, Limits, SandboxError, Session, TestRun, check_languages, check_sandbox

__all__ = ["LANGUAGES", "VERDICTS", "Judgement", "Limits", "Problem", "SandboxError", "SandboxSettings",
           "SandboxUnavailable", "Session", "Test", "TestRun", "UNSAFE_VARIABLE", "check_languages", "check_sandbox",
           "judge"]
