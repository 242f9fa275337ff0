"""`python`: run a Python program for the model (rollout.tools: [gspo_mcore.tools.python:python]).

The code runs in the sandbox (gspo_mcore.sandbox, docs/13-code-rl.md): a bubblewrap boundary with
no network, no view of the host's files but the interpreter's and the stated packages' (numpy,
sympy, mpmath: gspo_mcore.sandbox.launch.PACKAGES, read-only) and a private tmpfs, no
environment (but one thread for numpy's BLAS), its own non-root uid, a seccomp filter, and
limits on CPU time (CPU_SECONDS),
memory (MEMORY_BYTES), processes and the wall clock; what it prints comes back (stdout, then
stderr), cut to OUTPUT_CHARS. It cannot read the trainer's keys or checkpoints or reach the
network. Where the sandbox cannot start, importing this tool stops the run with one line saying
why (GSPO_SANDBOX_UNSAFE_NO_ISOLATION=1 is the explicit, unsafe, rlimits-only way round).
Each call is a fresh sandbox: nothing persists between calls.
"""

from __future__ import annotations

from gspo_mcore.sandbox import Limits, SandboxError, Session, check_sandbox

CPU_SECONDS = 10
WALL_SECONDS = 20
MEMORY_BYTES = 2 * 1024**3
OUTPUT_CHARS = 4000

check_sandbox()  # at import: the trainer's load_tools and each tool worker refuse to start without it


def python(code: str) -> str:
    """Run a Python program (the standard library, numpy, sympy) and return what it prints. Use print().

    Args:
        code: The complete program, e.g. "print(sum(range(10)))".
    """
    limits = Limits(cpu_s=CPU_SECONDS, wall_s=WALL_SECONDS, memory_bytes=MEMORY_BYTES, output_bytes=4 * OUTPUT_CHARS)
    try:
        with Session(code, limits=limits) as session:
            run = session.run("")
    except SandboxError as err:
        return f"error: the sandbox failed ({err})"
    out = run.stdout + (f"\n{run.stderr}" if run.stderr else "")
    if run.status == "timeout":
        out += f"\nerror: the program ran longer than {WALL_SECONDS} s"
    elif run.status == "output_limit":
        out += "\nerror: the program printed too much"
    elif run.signal is not None:
        out += f"\nerror: the program was killed by signal {run.signal} (CPU {CPU_SECONDS} s / memory limits)"
    elif run.exit_code:  # a traceback alone does not tell the model its program failed (sys.exit(3) prints nothing)
        out += f"\nerror: the program exited with status {run.exit_code}"
    out = out.strip() or "(no output: use print())"
    return out if len(out) <= OUTPUT_CHARS else out[:OUTPUT_CHARS] + f"...[truncated {len(out) - OUTPUT_CHARS} chars]"
