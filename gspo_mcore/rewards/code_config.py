"""`reward.code`: the code reward's settings and the sandbox's per-test limits
(gspo_mcore.rewards.code reads them). Imports nothing heavy: the config imports it, and so does
a reward worker, which must not import torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

LANGUAGES = ("python", "cpp")  # what gspo_mcore.sandbox judges (its LANGUAGES; `languages` below spells them)


@dataclass(frozen=True)
class CodeRewardConfig:
    infrastructure_errors: Literal["zero", "mask"] = "zero"
    """A response whose program could not be judged (the sandbox did not start, the harness
    crashed or broke its protocol, the problem's checker is broken): `zero` scores it 0; `mask`
    drops it from its group before the advantages (it neither scores nor trains; a round where
    more than reward.max_error_fraction are masked stops the run). Either way it is counted
    (code_infrastructure_errors) and never a pass. `zero` by default: where a program can cause
    one (the sandbox started by a user that is not root: the program may kill the harness),
    masking would spare a wrong program its negative advantage; `mask` suits root hosts, where
    only the host's own faults cause them (whatever a program does, in its own sandbox, is its
    own verdict: tests/test_sandbox.py's saboteurs)."""
    scoring: Literal["all_pass", "fraction"] = "all_pass"
    """1 when every test run passes, else 0; or the share of the tests run that passed (every
    test of the training subset runs then: no stop at the first failure)."""
    max_train_tests: int = 16
    """Training (`code`, `code_group_reward`): at most this many tests per problem, a
    deterministic subset (the first in an order fixed by each input's hash), stopping at the first
    failure. Evaluation (`code_all`) runs every test."""
    hack_check_share: float = 0.125
    """The share of responses passing their training subset that also run every other test: those
    that then fail are the hack rate (code_hack_rate). 0: off."""
    cpu_s: float = 4.0
    """CPU seconds per test (RLIMIT_CPU, and the `timeout` verdict), where the problem gives no
    time limit of its own."""
    wall_s: float = 8.0
    """Wall-clock seconds per test, from the host (a program that sleeps or blocks); >= cpu_s."""
    memory_mb: int = 1024
    """Address space per test process (RLIMIT_AS, MiB): a forked interpreter maps ~30 MiB of it
    before the program runs. Where the host has cgroups, the whole sandbox (every process, its
    tmpfs, the kernel memory it causes) is bounded too, to this plus the tmpfs and output."""
    output_mb: int = 16
    """A test's stdout (functional: its returned value's JSON), MiB: more ends the test with its
    own verdict, `output_limit` (a contest's 2 x 10^5 numbers are ~1.3 MB)."""
    dataset_time_limits: bool = True
    """A problem's own time limit (CodeContests `time_limit`, TACO `time_limit`, a `time_limit_s`
    field; prepare_code keeps it), times dataset_time_factor, replaces cpu_s for its tests; the
    wall-clock limit keeps wall_s / cpu_s's ratio to it. Memory limits of the datasets are not
    applied: they bound a C++ program's resident memory, not a Python interpreter's address space."""
    dataset_time_factor: float = 1.0
    """Datasets' time limits were set for C++: run `python -m gspo_mcore.rewards.code --references`
    and raise this where correct reference solutions time out."""
    languages: list[Literal["python", "cpp"]] = field(default_factory=lambda: list(LANGUAGES))
    """The languages judged: `python` (a ```python, ```py or untagged block) and `cpp` (```cpp,
    ```c++, ```cxx, ```cc: compiled with g++ -std=gnu++17 -O2 in the sandbox, stdin problems only).
    The program is the response's last block in one of them; blocks in other languages are passed
    over. With cpp, a run on a machine without g++ stops at start-up saying so."""
    compile_cpu_s: float = 10.0
    """A C++ program's build: CPU seconds, its processes' together (each also under RLIMIT_CPU; the
    wall clock at 3x); past it, or any build failure, the verdict is compile_error. `#include <bits/stdc++.h>` at -O2
    takes 0.4 s with the sandbox's precompiled header, 1.4-3 s without."""
    compile_memory_mb: int = 2048
    """A C++ program's build: address space per compiler process (RLIMIT_AS, MiB; cc1plus builds
    bits/stdc++.h within 256 MiB)."""

    def group_seconds(self, programs: int) -> float:
        """The longest `programs` correct programs of one call may take: judged one after another,
        each runs every training test to its CPU limit (a pass never stops early), C++ built first
        to its limit. A dataset's own time limit (dataset_time_limits) can raise a problem's."""
        build = self.compile_cpu_s if "cpp" in self.languages else 0.0
        return programs * (self.max_train_tests * self.cpu_s + build)

    def problem(self) -> str | None:
        """The first bad value, as `field: why`; None when all are good."""
        if self.max_train_tests < 1:
            return "max_train_tests: must be >= 1"
        if not 0 <= self.hack_check_share <= 1:
            return "hack_check_share: must be in [0, 1]"
        if self.cpu_s <= 0:
            return "cpu_s: must be > 0"
        if self.wall_s < self.cpu_s:
            return f"wall_s: must be >= cpu_s ({self.cpu_s:g})"
        if self.memory_mb < 64:
            return "memory_mb: must be >= 64 (the interpreter alone maps ~30 MiB)"
        if not 1 <= self.output_mb <= 1024:
            return "output_mb: must be in [1, 1024]"
        if self.dataset_time_factor <= 0:
            return "dataset_time_factor: must be > 0"
        if not self.languages or not set(self.languages) <= set(LANGUAGES):
            return f"languages: {list(self.languages)} must be a non-empty list of {list(LANGUAGES)}"
        if self.compile_cpu_s <= 0:
            return "compile_cpu_s: must be > 0"
        if self.compile_memory_mb < 256:
            return "compile_memory_mb: must be >= 256 (bits/stdc++.h needs about that)"
        return None
