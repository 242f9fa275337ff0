import json
import subprocess
import sys

import pytest

from gspo_mcore.common.errors import InputError
from gspo_mcore.rewards import load_reward_fn
from gspo_mcore.rewards.answers import exact_match_reward, last_boxed, math_reward
from gspo_mcore.rewards.runner import RewardRunner
from helpers import REPO, ToyHandler, environment, kill_and_reap, reaped, start, toy_server, url



def test_last_boxed_balances_braces():
    assert last_boxed(r"first \boxed{1} then \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert last_boxed("no box") is None
    assert last_boxed(r"cut off \boxed{\frac{1}{2") is None


@pytest.mark.parametrize(
    "response, answer, expected",
    [
        (r"so the answer is $\boxed{\frac{1}{2}}$", "0.5", 1.0),
        (r"$\boxed{0.5}$", r"\frac{1}{2}", 1.0),
        (r"$\boxed{2\sqrt{2}}$", r"\sqrt{8}", 1.0),
        (r"$\boxed{3}$", "4", 0.0),
        ("4 but never boxed", "4", 0.0),
    ],
)
def test_math_reward(response, answer, expected):
    assert math_reward(response, answer) == expected


def test_exact_match():
    assert exact_match_reward(r"... \boxed{ 42 }", "42") == 1.0
    assert exact_match_reward("  hello   world ", "hello world") == 1.0
    assert exact_match_reward("hello", "world") == 0.0


def test_import_path_and_errors():
    assert load_reward_fn("tests.reward_fixtures:length_reward")("abc", "") == 3.0
    with pytest.raises(InputError, match="nor 'module:function'"):
        load_reward_fn("fuzzy")
    with pytest.raises(InputError, match="cannot import"):
        load_reward_fn("tests.reward_fixtures:missing")


def test_runner_scores_and_counts_crashes_and_timeouts():
    runner = RewardRunner("tests.reward_fixtures:moody_reward", timeout_s=2.0, workers=2)
    try:
        responses = ["ok", "crash", "hang", "ok", "nan", "ok"]  # a NaN counts as a failure, like a raise
        rewards, stats = runner.score(responses, ["1"] * 6)
        assert rewards == [1.0, 0.0, 0.0, 1.0, 0.0, 1.0]
        assert (stats.errors, stats.timeouts) == (2, 1)
        rewards, stats = runner.score(["ok"], ["1"])  # a fresh pool after the timeout
        assert rewards == [1.0] and (stats.errors, stats.timeouts) == (0, 0)
    finally:
        runner.close()


def test_runner_math_reward():
    runner = RewardRunner("math", timeout_s=30.0, workers=1)
    try:
        rewards, _ = runner.score([r"\boxed{\frac{2}{4}}", r"\boxed{7}"], ["0.5", "8"])
        assert rewards == [1.0, 0.0]
    finally:
        runner.close()


def test_a_ctrl_c_to_the_trainers_process_group_does_not_reach_its_reward_workers():
    """A terminal's Ctrl-C goes to the command's process group: reward workers there died of it with
    KeyboardInterrupt tracebacks inside the trainer's stop message. They run in sessions of their own."""
    import os

    runner = RewardRunner("tests.reward_fixtures:chatty_reward", timeout_s=5.0, workers=2)
    try:
        runner.score(["a"], [""])
        for worker in runner._pool:
            assert os.getsid(worker.process.pid) == worker.process.pid != os.getsid(0)
    finally:
        runner.close()


def test_runner_reward_prints_and_dead_worker():
    runner = RewardRunner("tests.reward_fixtures:chatty_reward", timeout_s=5.0, workers=1)
    try:
        assert runner.score(["a", "b"], ["", ""])[0] == [0.5, 0.5]
        runner._pool[0].process.kill()  # a worker gone between steps is replaced, nothing lost
        runner._pool[0].process.wait()
        rewards, stats = runner.score(["a"], [""])
        assert rewards == [0.5] and (stats.errors, stats.timeouts) == (0, 0)
    finally:
        runner.close()


def test_a_worker_that_cannot_start_is_one_line():
    runner = RewardRunner("tests.reward_fixtures:length_reward", timeout_s=5.0, workers=1)
    runner.reward_name = "tests.no_such_module:f"  # importable here, not in the worker
    with pytest.raises(InputError, match="worker did not start"):
        runner.score(["a"], [""])


SLOW_MAIN = """
import json, sys, time
time.sleep(1.5)  # a heavy main module (the trainer imports torch and megatron at the top)
from gspo_mcore.rewards.runner import RewardRunner
if __name__ == "__main__":
    runner = RewardRunner(sys.argv[1], timeout_s=1.0, workers=2)
    rewards, stats = runner.score(["abc"] * 8, [""] * 8)
    runner.close()
    print(json.dumps({"rewards": rewards, "timeouts": stats.timeouts, "errors": stats.errors}))
"""


@pytest.mark.parametrize("reward", ["tests.reward_fixtures:length_reward", "tests.slow_import_reward:reward"])
def test_the_limit_counts_the_reward_only(tmp_path, reward):
    """A 1 s limit with a fast reward, under a main module that takes 1.5 s to import (spawned
    workers used to re-import it inside the first response's limit: every response timed out)
    or a reward module that takes 1.5 s to import."""
    script = tmp_path / "main.py"
    script.write_text(SLOW_MAIN)
    env = environment(warnings=True)
    proc = subprocess.run([sys.executable, str(script), reward], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (result["timeouts"], result["errors"]) == (0, 0)
    assert result["rewards"] == [3.0 if "length" in reward else 1.0] * 8


def _contexts(*prompts, **extra):
    return [{"prompt": p, "messages": [{"role": "user", "content": p}], "extra": dict(extra)} for p in prompts]


def test_a_reward_that_takes_the_prompt_gets_it():
    runner = RewardRunner("tests.reward_fixtures:prompt_reward", timeout_s=5.0, workers=1)
    try:
        assert runner.wanted == ("prompt",)
        rewards, stats = runner.score(["what is 2+2?", "4"], ["4", "4"], _contexts("what is 2+2?", "what is 2+2?"))
        assert rewards == [1.0, 0.0] and (stats.errors, stats.timeouts) == (0, 0)
    finally:
        runner.close()


def test_record_fields_by_name_all_fields_and_the_chat():
    runner = RewardRunner("tests.reward_fixtures:field_reward", timeout_s=5.0, workers=1)
    try:
        assert runner.wanted == ("level", "extra", "messages")
        contexts = _contexts("p", level="Level 2", source="aime") + _contexts("q", source="aime")
        rewards, _ = runner.score(["a", "b"], ["1", "1"], contexts)
        assert rewards == [121.0, 110.0]  # the second record has no `level`: the default applies
    finally:
        runner.close()


def test_a_batched_reward_scores_each_group_in_one_call():
    runner = RewardRunner("tests.reward_fixtures:group_sizes", timeout_s=5.0, workers=2, batched=True)
    try:
        rewards, stats = runner.score(list("abcdef"), [""] * 6, groups=[0, 0, 0, 1, 1, 2])
        assert rewards == [3.0, 3.0, 3.0, 2.0, 2.0, 1.0] and (stats.errors, stats.timeouts) == (0, 0)
        # One reward per response or the whole group fails, counted per response.
        rewards, stats = runner.score(["wrong length", "x", "y"], [""] * 3, groups=[0, 0, 1])
        assert rewards == [0.0, 0.0, 1.0] and stats.errors == 2
    finally:
        runner.close()


def test_a_reward_model_served_over_http(monkeypatch):
    """`reward.url` reaches a batched reward that posts the group to SGLang's /classify."""
    class Classify(ToyHandler):
        def do_POST(self):
            texts = self.body()["text"]
            self.json(200 if self.path == "/classify" else 404,
                      [{"embedding": [float(len(t))], "meta_info": {}} for t in texts])

    with toy_server(Classify) as server:
        runner = RewardRunner("tests.reward_fixtures:scored_by_server", timeout_s=10.0, workers=1, batched=True,
                              url=url(server))
        try:
            rewards, stats = runner.score(["x", "yy"], ["", ""], _contexts("q", "q"), groups=[0, 0])
            assert rewards == [len("q => x"), len("q => yy")] and stats.errors == 0
            runner.url = url(server) + "/nowhere"  # a server that refuses: the group fails, counted
            assert runner.score(["x"], [""], _contexts("q"), groups=[0])[1].errors == 1
        finally:
            runner.close()


@pytest.mark.parametrize("name, url, message", [
    ("tests.reward_fixtures:scored_by_server", None, "takes `url`, but reward.url is not set"),
    ("tests.reward_fixtures:length_reward", "http://rm:30000", "reward.url: reward .* takes no `url` parameter"),
    ("tests.reward_fixtures:one_argument", None, r"takes 1 positional parameters, expected \(response, answer"),
])
def test_signatures_that_cannot_be_served_are_one_line(name, url, message):
    with pytest.raises(InputError, match=message):
        RewardRunner(name, url=url)


ORPHAN_MAIN = """
import threading
from gspo_mcore.rewards.runner import RewardRunner

def score():
    runner = RewardRunner("tests.reward_fixtures:moody_reward", timeout_s=600, workers=1)
    runner.score(["hang"], ["x"])  # the worker sleeps in the reward when the trainer dies

# Started by a producer thread (asynchronous modes): no parent-death signal from the kernel.
threading.Thread(target=score, daemon=True).start()
threading.Event().wait()
"""


def test_no_reward_worker_outlives_a_killed_trainer(tmp_path):
    """It was left behind: started from a thread and busy in the reward, it never read the end of
    its input."""
    import time

    import psutil

    script = tmp_path / "main.py"
    script.write_text(ORPHAN_MAIN)
    workers = []
    with reaped(start([sys.executable, str(script)], env=environment(warnings=True))) as trainer:
        try:
            deadline = time.monotonic() + 60
            while not (workers := psutil.Process(trainer.pid).children()) and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(3)  # the worker started and took the request
            assert workers
            kill_and_reap(trainer, children=workers)
        finally:
            for worker in [*workers, *psutil.Process().children(recursive=True)]:
                if worker.is_running():
                    worker.kill()


def test_reasons_reach_the_runner_and_one_that_is_not_json_comes_as_text():
    """A reward's reward_reasons() travels with each reply (by response), the failed calls'
    messages beside them; what json cannot write in a reason is sent as its str, not a dead worker."""
    runner = RewardRunner("tests.reward_fixtures:category_saying_why", timeout_s=10.0, workers=1)
    try:
        rewards, stats = runner.score(["color_1 x", "fruit_2 y"], ["color", "color"])
    finally:
        runner.close()
    assert rewards == [1.0, 0.0] and stats.reasons == {1: "not a color: ['fruit_2']"}
    runner = RewardRunner("tests.reward_fixtures:reasons_not_json", timeout_s=10.0, workers=1)
    try:
        rewards, stats = runner.score(["a"], ["b"])
    finally:
        runner.close()
    assert rewards == [0.0] and stats.errors == 0 and stats.reasons == {0: {"seen": "{1, 2}"}}
    runner = RewardRunner("tests.reward_fixtures:always_raises", timeout_s=10.0, workers=1)
    try:
        _, stats = runner.score(["a"], ["b"])
    finally:
        runner.close()
    assert stats.reasons == {0: "reward error: RuntimeError: this reward never works"}
