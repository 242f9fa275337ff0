"""Every benchmark in bench/ runs: its `--smoke` mode (the smallest sizes that still take every
path it times) prints its last JSON line with every key its full run prints. Benchmarks are not
tests of the figures; this keeps a refactor from breaking one unnoticed (bench/step.py imported
a function that had moved). The benches that train share one server of the long task's model."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from helpers import REPO, last_json_line, run_module


# bench -> the keys of its last line (a full run's; the smoke run must print the same).
STEP_KEYS = {"step_time_ratio", "train_time_ratio", "engine_step_s", "recompute_step_s", "rollout_s", "engine_train_s",
             "recompute_train_s", "steps"}
ASYNC_KEYS = {"async_speedup", "one_step_off_speedup", "async_restart_speedup", "async_first_minibatch_speedup",
              "overlap_bound", "max_staleness_seen", "tokens_regenerated", "tokens_regenerated_restart",
              "reward_last_steps", "reward_in_time", "reward_held_out"}
CLAIM_ARM_KEYS = {"final_reward_mean", "final_reward_sd", "final_reward_per_seed", "steps_to_threshold",
                  "mismatch_seq", "mismatch_token", "out_of_band", "routing_mismatch", "clip_fraction",
                  "train_s_per_step", "token_mask_fraction", "sequence_mask_fraction", "clip_band_high"}
COMPARISONS = {"bf16 engine vs fp32 trainer", "bf16 engine vs bf16 weights trainer", "bf16 engine vs bf16 trainer",
               "bf16 trainer vs fp32 trainer", "bf16 engine decode vs its prefill", "fp32 engine vs fp32 trainer",
               "fp32 engine decode vs its prefill"}


@pytest.fixture(scope="module")
def long_task():
    """configs/long_cpu.yaml's task, where the benches read it."""
    from gspo_mcore.tasks.long import make_long_task

    return make_long_task(REPO / "outputs" / "long_task")


@pytest.fixture(scope="module")
def long_task_server(long_task, tmp_path_factory):
    """The long task's model served with its routed experts (bench/claim.py asks for them): every
    bench that trains pushes its own weights first."""
    from gspo_mcore.common.processes import ManagedServer
    from gspo_mcore.engines.sglang.server import sglang_command
    from gspo_mcore.engines.sglang.sglang_cpu import server_env

    def command(port):
        return sglang_command(str(long_task / "model"), port, max_running_requests=64,
                              extra_args=("--enable-return-routed-experts",))

    log = tmp_path_factory.mktemp("logs") / "sglang.log"
    with ManagedServer.on_free_port(command, log, env=server_env()) as managed:
        yield managed.url


# The smoke runs go to one worker, one after another: they share a server and the machine's cores.
def smoke_run(test):
    return pytest.mark.slow(pytest.mark.xdist_group("bench")(test))


def smoke(script: str, *args: str, timeout: int = 600) -> dict:
    return last_json_line(run_module([f"bench/{script}", "--smoke", *args], timeout=timeout).stdout)


@smoke_run
def test_logprobs_bench():
    line = smoke("logprobs.py")
    assert set(line) == {"peak_mem_ratio", "time_ratio", "fused_peak_ratio_vs_chunked", "fused_time_ratio_vs_chunked"}
    assert all(value > 0 for value in line.values())


@smoke_run
def test_convert_bench():
    line = smoke("convert.py")
    assert set(line) == {"hf_to_mcore_vs_cp", "mcore_to_hf_vs_cp", "peak_rss_gb_hf_to_mcore",
                         "peak_rss_gb_mcore_to_hf", "checkpoint_gb"}
    assert 0 < line["checkpoint_gb"] < 0.1


@smoke_run
def test_step_bench(long_task_server):
    line = smoke("step.py", f"rollout.urls=[{long_task_server}]")
    assert set(line) == STEP_KEYS and line["steps"] == 1 and line["step_time_ratio"] > 0


@smoke_run
def test_async_bench(long_task_server, tmp_path):
    line = smoke("async.py", "--out", str(tmp_path), "--url", long_task_server)
    assert set(line) == ASYNC_KEYS
    assert line["async_speedup"] > 0 and line["one_step_off_speedup"] is None
    assert set(line["reward_held_out"]) == {"sync", "async"}
    assert line["max_staleness_seen"] <= 1
    assert (tmp_path / "plots").is_dir()


@smoke_run
def test_claim_bench(long_task_server, tmp_path):
    line = smoke("claim.py", "--out", str(tmp_path), f"rollout.urls=[{long_task_server}]")
    assert set(line) == {"arms"} and set(line["arms"]) == {"gspo-engine", "gspo-recompute"}
    for figures in line["arms"].values():
        assert set(figures) == CLAIM_ARM_KEYS
        assert figures["routing_mismatch"] is not None  # the routed experts arrived
    assert (tmp_path / "claim.md").is_file() and (tmp_path / "reward.png").is_file()


LOSSES_ARM_KEYS = (CLAIM_ARM_KEYS - {"steps_to_threshold"}) | {
    "response_length", "mismatch_kl", "mismatch_truncated_fraction", "mismatch_masked_fraction"}


@smoke_run
def test_losses_bench(long_task_server, tmp_path):
    line = smoke("losses.py", "--out", str(tmp_path), f"rollout.urls=[{long_task_server}]")
    assert set(line) == {"arms"} and set(line["arms"]) == {"sapo", "cispo"}
    for figures in line["arms"].values():
        assert set(figures) == LOSSES_ARM_KEYS
        assert figures["response_length"] > 0 and figures["mismatch_seq"] is not None
    assert line["arms"]["sapo"]["clip_fraction"] is None  # a soft gate clips nothing
    assert (tmp_path / "losses.md").is_file() and (tmp_path / "reward.png").is_file()


@smoke_run
def test_mismatch_sources_bench(long_task):
    """Its own bf16 and fp32 servers (the comparison is between engine precisions)."""
    line = smoke("mismatch_sources.py")
    assert set(line) == COMPARISONS
    assert all(figures["tokens"] > 0 for figures in line.values())


@smoke_run
def test_weight_sync_bench():
    line = smoke("weight_sync.py")
    assert set(line) == {"ratio_vs_copy", "disk_ratio_vs_copy", "sizes"} and set(line["sizes"]) == {"tiny"}
    assert set(line["sizes"]["tiny"]) == {"ratio_vs_copy", "disk_ratio_vs_copy", "bytes"}
    assert line["sizes"]["tiny"]["bytes"] > 0 and line["ratio_vs_copy"] >= 0  # the tiny size's rounds to 0.0


@smoke_run
def test_packing_sim_bench():
    line = smoke("packing_sim.py")
    assert set(line) == {"rows", "padding_range", "bshd_over_thd_range"} and len(line["rows"]) == 1
    row = line["rows"][0]
    assert 0 < row["padding"] <= row["padding_with_fillers"] < 1 and row["bshd_fillers_over_thd"] >= 1
    assert row["thd_over_ideal"] >= 1


def _documented_commands() -> list[tuple[str, list[str]]]:
    """Every `python bench/NAME.py ...` command the README and docs/ quote (inline code, which may
    wrap over lines): (bench, its arguments)."""
    texts = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    found = []
    for text in (path.read_text() for path in texts):
        blocks = re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.DOTALL)
        spans = re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", text, flags=re.DOTALL))
        for code in [line for block in blocks for line in block.splitlines()] + spans:
            match = re.search(r"python bench/(\w+)\.py((?:\s+[^\s`]+)*)", code)
            if match:
                found.append((match.group(1), match.group(2).split()))
    return found


# Each bench's `--help` in one Python (the benches' imports, ~2.5 s each, paid once), as
# `python bench/NAME.py --help` runs it: the script as __main__, its folder first on sys.path.
HELPS = """
import contextlib, io, json, runpy, sys
helps = {}
for name in sys.argv[1:]:
    sys.argv, sys.path[0], out = [f"bench/{name}.py", "--help"], "bench", io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_path(f"bench/{name}.py", run_name="__main__")
            code = None
        except SystemExit as done:
            code = done.code
    helps[name] = [code, out.getvalue()]
print(json.dumps(helps))
"""


@pytest.mark.slow  # imports every bench
def test_documented_bench_commands_match_their_help():
    """Each documented command names only options its bench takes, and every option the bench
    requires (its --help is the reference)."""
    commands = _documented_commands()
    assert {name for name, _ in commands} >= {"step", "async", "claim", "convert", "logprobs", "weight_sync",
                                             "mismatch_sources", "client", "rank0"}
    done = subprocess.run([sys.executable, "-c", HELPS, *sorted({name for name, _ in commands})], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    helps = {}
    for name, (code, text) in json.loads(done.stdout.splitlines()[-1]).items():
        assert code in (0, None) and "--help" in text, (name, code, text[-2000:])
        usage = text.split("\n\n")[0]
        helps[name] = (set(re.findall(r"(--[\w-]+)", text)),
                       set(re.findall(r"(?<!\[)(--[\w-]+) [A-Z]", re.sub(r"\[[^\]]*\]", "", usage))))
    for name, args in commands:
        options, required = helps[name]
        used = {a.split("=")[0] for a in args if a.startswith("--")}
        assert used <= options, f"bench/{name}.py {' '.join(args)}: {sorted(used - options)} not in its --help"
        assert required <= used, f"bench/{name}.py {' '.join(args)}: misses the required {sorted(required - used)}"


ENGINE_KEYS = {"reward_first", "reward_last", "reward_gain", "generated_tokens_per_s", "step_s", "mismatch_max",
               "server_start_s", "run_s", "steps"}


@smoke_run
def test_engines_bench():
    """Both CPU defaults, 2 steps each: every key of the full run's line."""
    line = smoke("engines.py", timeout=900)
    assert set(line) == {"sglang", "vllm", "reward_gain_ratio", "tokens_per_s_ratio", "step_time_ratio"}
    assert all(set(line[engine]) == ENGINE_KEYS and line[engine]["steps"] == 2 for engine in ("sglang", "vllm"))
    assert line["tokens_per_s_ratio"] > 0


@smoke_run
def test_client_bench():
    """A stand-in engine in its own process; the real client ingesting from it."""
    line = smoke("client.py")
    assert {"ingest_tokens_per_s", "trainer_slowdown", "achieved_tokens_per_s_under_load"} <= set(line)
    assert line["ingest_tokens_per_s"] > 0 and line["achieved_tokens_per_s_under_load"] > 0


@smoke_run
def test_rank0_bench():
    line = smoke("rank0.py")
    assert set(line) == {"cpu_ms_per_response", "core_share_at_rate", "core_left_for_training",
                         "pickled_mb_per_response", "routed_experts_mb_per_response", "response_tokens", "tokens_per_s"}
    assert line["cpu_ms_per_response"] > 0 and 0 < line["routed_experts_mb_per_response"] < line["pickled_mb_per_response"]


@smoke_run
def test_sandbox_bench():
    """Trivial tests through the whole code-reward path: bubblewrap, harness, a fork per test."""
    line = smoke("sandbox.py")
    assert set(line) == {"tests_per_s", "tests_per_s_2_workers", "tests_per_s_group_of_8", "response_overhead_ms",
                         "cold_start_ms", "test_ms"}
    assert line["tests_per_s"] > 0 and line["test_ms"] > 0
