"""`python`: run a Python program for the model (rollout.tools: [gspo_mcore.tools.python:python]).

The code runs in a fresh interpreter (`python -I`: no user site, no PYTHON* variables), in an
empty temporary directory, with an empty environment (no secrets, no proxies), a CPU-time limit
(RLIMIT_CPU), an address-space limit (RLIMIT_AS), no core files, and a wall-clock timeout; what
it prints comes back (stdout, then stderr), cut to a few thousand characters. This is resource
isolation, not a sandbox: the code can read what the user running the trainer can read and
reach the network. Untrusted code (a model's, during RL) belongs in a container or a VM without
credentials: run the trainer's tool workers there.
"""

from __future__ import annotations

import resource
import subprocess
import sys
import tempfile

CPU_SECONDS = 10
WALL_SECONDS = 20
MEMORY_BYTES = 2 * 1024**3
OUTPUT_CHARS = 4000


def _limits() -> None:  # in the child, before exec
    resource.setrlimit(resource.RLIMIT_CPU, (CPU_SECONDS, CPU_SECONDS))
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def python(code: str) -> str:
    """Run a Python program and return what it prints. Use print() to see results.

    Args:
        code: The complete program, e.g. "print(sum(range(10)))".
    """
    with tempfile.TemporaryDirectory(prefix="gspo-python-") as cwd:
        try:
            done = subprocess.run([sys.executable, "-I", "-c", code], cwd=cwd, env={}, capture_output=True, text=True,
                                  timeout=WALL_SECONDS, preexec_fn=_limits)
        except subprocess.TimeoutExpired:
            return f"error: the program ran longer than {WALL_SECONDS} s"
    out = done.stdout + (f"\n{done.stderr}" if done.stderr else "")
    if done.returncode < 0:
        out += f"\nerror: the program was killed by signal {-done.returncode} (CPU {CPU_SECONDS} s / memory limits)"
    out = out.strip() or "(no output: use print())"
    return out if len(out) <= OUTPUT_CHARS else out[:OUTPUT_CHARS] + f"...[truncated {len(out) - OUTPUT_CHARS} chars]"
