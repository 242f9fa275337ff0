"""C++ answers (issue 46, item 5): a ```cpp block is compiled with g++ inside the sandbox under
limits of its own and run per test as a Python program is; a correct one passes, a wrong one is
wrong, one that does not compile is compile_error, a compile bomb is bounded; where no compiler
exists, one line says so. Before: the block ran as Python (a runtime_error, whatever its merit)."""

from __future__ import annotations

import time

import pytest

from gspo_mcore.rewards import code as code_reward
from gspo_mcore.rewards.code import answer_from_problem, code_group_reward, score
from gspo_mcore.rewards.code_config import CodeRewardConfig
from gspo_mcore.sandbox import Limits, Problem, SandboxUnavailable, Session, Test, check_languages, judge, launch
from gspo_mcore.sandbox.judge import judge_programs
from gspo_mcore.sandbox.preflight import preflight

FAST = Limits(cpu_s=2, wall_s=4, memory_bytes=512 * 1024**2, processes=16)
SMALL_BUILD = Limits.compile(cpu_s=1, memory_bytes=512 * 1024**2)
ADD = Problem("stdin", (Test("2 3\n", "5\n"), Test("10 -4\n", "6\n")))
CORRECT = '#include <cstdio>\nint main() { long long a, b; scanf("%lld %lld", &a, &b); printf("%lld\\n", a + b); }\n'


def fenced(source: str, tag: str = "cpp") -> str:
    return f"Here is my solution.\n```{tag}\n{source}```\n"


def test_a_correct_cpp_answer_passes_and_a_wrong_one_is_wrong():
    assert judge(CORRECT, ADD, limits=FAST, language="cpp").verdicts == ["passed", "passed"]
    assert judge(CORRECT.replace("a + b", "a * b"), ADD, limits=FAST, language="cpp").verdicts == ["wrong"]
    # the same text as Python (what the old code did with every block): never a pass
    assert judge(CORRECT, ADD, limits=FAST).verdicts == ["runtime_error"]


def test_a_program_that_does_not_compile_is_compile_error_with_the_compilers_message():
    judgement = judge("int main() { return undeclared; }\n", ADD, limits=FAST, language="cpp")
    assert judgement.verdicts == ["compile_error"] and judgement.infrastructure_error is None
    assert "undeclared" in judgement.compile_output


@pytest.mark.parametrize("bomb, said", [
    ('#include "/dev/zero"\n', "memory"),  # a huge include: cc1plus reads it into memory
    ("constexpr long fib(int n) { return n < 2 ? n : fib(n - 1) + fib(n - 2); }\n"
     "constexpr long x = fib(90);\nint main() { return x; }\n", "limit"),  # exponential compile-time recursion
    ("template <int N> struct R { static const int v = R<N + 1>::v; };\nint main() { return R<0>::v; }\n",
     "depth"),  # template recursion: g++'s own depth limit
])
def test_a_compile_bomb_is_bounded(bomb, said):
    started = time.monotonic()
    judgement = judge(bomb, ADD, limits=FAST, language="cpp", compile_limits=SMALL_BUILD)
    assert judgement.verdicts == ["compile_error"] and said in judgement.compile_output, judgement
    assert time.monotonic() - started < SMALL_BUILD.wall_s + 5


@pytest.mark.parametrize("stream", ["/dev/stdout", "/dev/stderr", "/dev/stdin", "/dev/fd/1", "/proc/self/fd/2"])
def test_a_compile_never_waits_on_its_own_streams(stream):
    """`#include "/dev/stdout"` opened the pipe the compiler itself wrote (cc1plus's to as under
    -pipe, the driver's to the harness) and waited, without CPU, for the 30 s wall limit (old code:
    `the compiler ran past its limit` after 30 s, every time). The compiler reads a source file and
    no stream: /dev/null in and out, its messages into a regular file; done at once, and the
    honest program after it still passes."""
    started = time.monotonic()
    judgement = judge(f'#include "{stream}"\n' + CORRECT, ADD, limits=FAST, language="cpp",
                      compile_limits=SMALL_BUILD)
    assert time.monotonic() - started < 5, judgement
    assert judgement.infrastructure_error is None and "past its limit" not in (judgement.compile_output or "")
    assert judge(CORRECT, ADD, limits=FAST, language="cpp").passed


def test_the_contest_header_is_precompiled_once_per_host():
    """`#include <bits/stdc++.h>` at -O2: 1.4-3 s of compile CPU here; with the header built once
    (the pre-flight, the scoring command) and bound read-only into the sandbox, ~0.4 s."""
    check_languages(["cpp"], prepare=True)
    assert (launch._pch_built / "bits" / "stdc++.h.gch").is_file()
    contest = "#include <bits/stdc++.h>\nusing namespace std;\nint main() { long long a, b; cin >> a >> b; cout << a + b; }\n"
    with Session(contest, language="cpp", limits=FAST, spare=False) as session:  # started after the build
        assert session.built and session.compiled.cpu_s < 1.0, session.compiled
        assert session.run("2 3\n").stdout == "5"


def test_a_cpp_program_runs_under_the_tests_limits():
    spin = "int main() { volatile unsigned long x = 0; for (;;) x++; }\n"
    assert judge(spin, ADD, limits=FAST, language="cpp").verdicts == ["timeout"]
    crash = "#include <cstdlib>\nint main() { abort(); }\n"
    assert judge(crash, ADD, limits=FAST, language="cpp").verdicts == ["runtime_error"]


def test_cpp_on_a_functional_problem_is_compile_error():
    problem = Problem("functional", (Test("[1]", "1"),), func_name="f")
    judgement = judge("int f(int x) { return x; }", problem, limits=FAST, language="cpp")
    assert judgement.verdicts == ["compile_error"] and "stdin problems only" in judgement.compile_output


def test_the_same_text_in_two_languages_is_judged_twice():
    python_and_cpp = judge_programs(["print(5)\n", "print(5)\n"], Problem("stdin", (Test("", "5\n"),)),
                                    limits=FAST, languages=["python", "cpp"])
    assert [j.verdicts for j in python_and_cpp] == [["passed"], ["compile_error"]]
    assert python_and_cpp[1].same_as is None


def test_the_reward_judges_the_block_by_its_tag():
    answer = answer_from_problem(ADD)
    python = fenced("a, b = map(int, input().split())\nprint(a + b)\n", "python")
    rewards = code_group_reward([fenced(CORRECT), fenced(CORRECT, "c++"), python, fenced(CORRECT, "java")],
                                [answer] * 4)
    assert rewards == [1.0, 1.0, 1.0, 0.0]  # java: not a judged language, no program
    only_python = CodeRewardConfig(languages=["python"])
    assert score(fenced(CORRECT), ADD, settings=only_python).no_program


def test_no_compiler_is_one_line(monkeypatch):
    real_which = launch.shutil.which
    monkeypatch.setattr(launch.shutil, "which", lambda name: None if name == "g++" else real_which(name))
    with pytest.raises(SandboxUnavailable) as refused:
        judge(CORRECT, ADD, limits=FAST, language="cpp")
    said = str(refused.value)
    assert "\n" not in said and "apt-get install g++" in said and "reward.code.languages: [python]" in said
    with pytest.raises(SandboxUnavailable, match=r"^sandbox: reward.name: code: C\+\+ answers .* g\+\+ is not"):
        preflight("reward.name: code", languages=["python", "cpp"])
    preflight("rollout.tools: python", languages=())  # the Python tool needs no compiler
    with pytest.raises(SandboxUnavailable, match="g\\+\\+ is not installed"):  # the reward's first call says it
        code_group_reward([fenced(CORRECT)], [answer_from_problem(ADD)])
    monkeypatch.setattr(code_reward, "SETTINGS", CodeRewardConfig(languages=["python"]))
    assert code_group_reward([fenced(CORRECT)], [answer_from_problem(ADD)]) == [0.0]  # Python only: no program


def test_the_languages_are_one_list():
    from typing import Literal, get_type_hints

    from gspo_mcore.rewards.code_config import LANGUAGES
    from gspo_mcore.sandbox import LANGUAGES as JUDGED

    assert LANGUAGES == JUDGED and get_type_hints(CodeRewardConfig)["languages"] == list[Literal[LANGUAGES]]
