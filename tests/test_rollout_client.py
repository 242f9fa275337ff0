"""The rollout client's retries and the server lifecycle, against a local stand-in server
(tests/fixtures/fake_engine.py) that can fail, die mid-batch and come back."""

import json
import re
import shutil
import sys
import threading
import time
import uuid

from pathlib import Path

import pytest

from helpers import REPO
from gspo_mcore.common.errors import InputError
from gspo_mcore.common.netaddr import free_port
from gspo_mcore.engines.base import check_sampling_params
from gspo_mcore.engines.sglang.client import SGLangClient
from gspo_mcore.common.errors import RolloutError
from gspo_mcore.common.processes import ManagedServer
from gspo_mcore.engines.sglang.server import sglang_command

PARAMS = {"max_new_tokens": 4, "temperature": 1.0}
PROMPTS = [[i, i + 1, 3] for i in range(12)]


def fake_server(tmp_path, port, *flags):
    cmd = [sys.executable, str(REPO / "tests" / "fixtures" / "fake_engine.py"), "--port", str(port),
           "--record", str(tmp_path / "answered.jsonl"), *flags]
    return ManagedServer(cmd, f"http://127.0.0.1:{port}", tmp_path / f"server-{port}.log", startup_timeout_s=30)


def expected_ids(prompt):
    return [(sum(prompt) + 7 * k) % 256 for k in range(PARAMS["max_new_tokens"])]


def test_generate_in_order(tmp_path):
    port = free_port()
    with fake_server(tmp_path, port):
        rollouts = SGLangClient([f"http://127.0.0.1:{port}"], 256).generate(PROMPTS, PARAMS)
    assert [r.response_ids for r in rollouts] == [expected_ids(p) for p in PROMPTS]
    assert [r.prompt_ids for r in rollouts] == PROMPTS


def test_lifecycle_leaves_no_process(tmp_path):
    port = free_port()
    server = fake_server(tmp_path, port).start()
    pid = server.process.pid
    assert server.healthy()
    # Its own TMPDIR (SGLang left IPC files and wandb's directories in /tmp at every start), removed at stop.
    tmp = server.tmp_dir
    environ = dict(item.split("=", 1) for item in open(f"/proc/{pid}/environ").read().split("\0") if "=" in item)
    assert tmp.is_dir() and environ["TMPDIR"] == str(tmp)
    server.stop()
    assert server.process.poll() is not None and not server.healthy() and not tmp.exists()
    with pytest.raises(ProcessLookupError):
        import os
        os.killpg(pid, 0)


def test_a_server_tmpdir_left_by_a_killed_trainer_goes_at_the_next_start(tmp_path, monkeypatch):
    """A SIGKILLed trainer cannot stop its servers (the kernel does), nor remove their TMPDIRs."""
    import os
    import subprocess
    import tempfile

    short = Path(tempfile.mkdtemp(prefix="t", dir="/tmp"))  # tmp_path may be too long (see below)
    monkeypatch.setenv("TMPDIR", str(short))
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    try:
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        orphan, live = short / f"gspo-server-{dead.pid}-abc", short / f"gspo-server-{os.getpid()}-def"
        (orphan / "ipc").mkdir(parents=True)
        live.mkdir()
        port = free_port()
        with fake_server(tmp_path, port) as server:
            assert server.tmp_dir.parent == short and server.tmp_dir.name.startswith(f"gspo-server-{os.getpid()}-")
        assert not orphan.exists() and live.exists()
    finally:
        tempfile.tempdir = None
        shutil.rmtree(short)


def test_a_long_tmpdir_puts_the_servers_tmpdir_where_its_sockets_can_be_named(tmp_path, monkeypatch):
    """A TMPDIR of 77 bytes (a test's tmp_path in CI) made SGLang's ZMQ IPC path 111 bytes, past
    sun_path's 107: the server exited at start. The server's own TMPDIR then goes to /tmp, still
    removed at stop; a short TMPDIR is kept."""
    import os
    import socket
    import tempfile

    from gspo_mcore.common.processes import SOCKET_PATH_MAX, server_tmp_root

    long_dir = tmp_path / ("d" * max(1, 80 - len(str(tmp_path))))
    long_dir.mkdir()
    monkeypatch.setenv("TMPDIR", str(long_dir))
    tempfile.tempdir = None
    try:
        assert server_tmp_root() == Path("/tmp")
        with fake_server(tmp_path, free_port()) as server:
            tmp = server.tmp_dir
            assert tmp.parent == Path("/tmp") and tmp.name.startswith(f"gspo-server-{os.getpid()}-")
            # what SGLang makes there: a tempfile name, bound as a Unix socket
            name = str(tmp / str(uuid.uuid4()))  # vLLM's name, the longer
            assert len(name) <= SOCKET_PATH_MAX
            with socket.socket(socket.AF_UNIX) as sock:
                sock.bind(name)
        assert not tmp.exists()
        short = tempfile.mkdtemp(prefix="t", dir="/tmp")
        monkeypatch.setenv("TMPDIR", short)
        tempfile.tempdir = None
        assert server_tmp_root() == Path(short)
        os.rmdir(short)
    finally:
        tempfile.tempdir = None


def test_server_that_exits_at_startup_is_reported(tmp_path):
    server = ManagedServer([sys.executable, "-c", "raise SystemExit(3)"], "http://127.0.0.1:9", tmp_path / "s.log")
    with pytest.raises(InputError, match="exited with code 3 while starting"):
        server.start()


def test_killed_mid_batch_and_restarted_loses_and_duplicates_nothing(tmp_path):
    port = free_port()
    first = fake_server(tmp_path, port, "--die-after", "5").start()
    restarted = {}

    def restart_when_dead():
        first.process.wait()
        time.sleep(0.5)
        restarted["server"] = fake_server(tmp_path, port).start()

    watcher = threading.Thread(target=restart_when_dead)
    watcher.start()
    try:
        client = SGLangClient([f"http://127.0.0.1:{port}"], 256, max_attempts=8, backoff_s=0.5, max_concurrency=4)  # ~2 min of retries: a loaded machine restarts slowly
        rollouts = client.generate(PROMPTS, PARAMS)
    finally:
        watcher.join(timeout=60)
        first.stop()
        if "server" in restarted:
            restarted["server"].stop()
    assert [r.response_ids for r in rollouts] == [expected_ids(p) for p in PROMPTS]
    # Every prompt came back exactly once, in its slot (above). The servers answered every prompt;
    # one whose reply died with the server may have been answered twice, which the client absorbs.
    answered = [tuple(json.loads(line)) for line in (tmp_path / "answered.jsonl").read_text().splitlines()]
    assert set(answered) == set(map(tuple, PROMPTS))


def test_server_gone_for_good_is_a_clear_error_in_bounded_time(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    client = SGLangClient([url], 256, max_attempts=3, backoff_s=0.1)
    start = time.monotonic()
    with pytest.raises(RolloutError, match=rf"request \d+: failed after 3 attempts; last: server {url}"):
        client.generate(PROMPTS[:2], PARAMS)
    assert time.monotonic() - start < 10


def test_5xx_is_retried_and_a_dead_server_is_skipped(tmp_path):
    port = free_port()
    with fake_server(tmp_path, port, "--fail-first", "3"):
        dead = f"http://127.0.0.1:{free_port()}"
        client = SGLangClient([dead, f"http://127.0.0.1:{port}"], 256, max_attempts=6, backoff_s=0.05)
        rollouts = client.generate(PROMPTS, PARAMS)
    assert [r.response_ids for r in rollouts] == [expected_ids(p) for p in PROMPTS]


def test_each_request_carries_its_seed_where_sglang_reads_it_and_a_retry_the_same():
    """SamplingParams.sampling_seed in the request's sampling_params (sglang/srt/sampling/
    sampling_params.py), one per request; the retry of a refused request sends the same one."""
    from helpers import ToyHandler, toy_server, url

    seen = []

    class Handler(ToyHandler):
        def do_POST(self):
            body = self.body()
            if self.path != "/generate":  # the close's /abort_request
                return self.json(200, {})
            seen.append((body["input_ids"], body["sampling_params"].get("sampling_seed")))
            if len(seen) == 1:
                return self.json(503, {"error": "busy"})
            ids = expected_ids(body["input_ids"])
            self.json(200, {"output_ids": ids, "meta_info": {
                "finish_reason": {"type": "length", "length": len(ids)}, "weight_version": "default",
                "output_token_logprobs": [[-1.0, t, None] for t in ids]}})

    with toy_server(Handler) as server:
        client = SGLangClient([url(server)], 256, backoff_s=0.01, max_concurrency=1)
        try:
            client.generate(PROMPTS[:3], PARAMS, seeds=[11, 2 ** 32 - 1, 0])
        finally:
            client.close()
    assert seen[0] == (PROMPTS[0], 11)  # refused, then retried (the others may go between)
    assert sorted(seen) == [(PROMPTS[0], 11), (PROMPTS[0], 11), (PROMPTS[1], 2 ** 32 - 1), (PROMPTS[2], 0)]


@pytest.mark.parametrize("params", [{"top_p": 0.9}, {"top_k": 20}, {"min_p": 0.1}, {"temperature": 0.0}])
def test_truncated_or_greedy_sampling_is_refused(params):
    with pytest.raises(InputError, match="sampling:"):
        check_sampling_params({**PARAMS, **params})


def test_sglang_command(tmp_path):
    from gspo_mcore.megatron.qwen3_moe.tiny import make_tiny_checkpoint

    all_moe = make_tiny_checkpoint(tmp_path / "moe", mlp_only_layers=[])
    cmd = sglang_command(str(all_moe), 30000)
    assert cmd[1:3] == ["-m", "sglang.launch_server"] and "--skip-tokenizer-init" in cmd
    assert cmd[cmd.index("--max-total-tokens") + 1] == "8192" and "torch_native" in cmd
    # Stop strings are matched on text: a server the run starts for them loads the tokenizer.
    from gspo_mcore.config import load_config
    from gspo_mcore.engines.sglang.server import server_for_config

    config = load_config(None, [f"model.hf_dir={all_moe}", "rollout.stop=['</answer>']", "data.tokenizer_dir=/tok"])
    cmd, _ = server_for_config(config, 30000)
    assert "--skip-tokenizer-init" not in cmd and cmd[cmd.index("--tokenizer-path") + 1] == "/tok"
    with_dense_layer = make_tiny_checkpoint(tmp_path / "dense", mlp_only_layers=[1])
    with pytest.raises(InputError, match="runs Qwen3-MoE dense layers"):
        sglang_command(str(with_dense_layer), 30000)


def test_a_request_restarted_during_an_aborting_push_is_restarted_again_if_aborted_again():
    """rollout.partial false: the push aborts the requests in flight and the client restarts them
    at once, so the restart waits on the paused server, registered there; SGLang's abort-mode
    pause aborts every registered request each second until none runs, so the restart can be
    aborted too, and its answer arrives after /continue_generation. That abort is the push's as
    well: the request starts over again, using no attempt (it failed the run with
    max_attempts 1 in CI: test_async_engine's restart test)."""
    client = SGLangClient(["http://stand-in"], 256, max_attempts=1)
    answers = []

    async def post(url, body):
        answers.append(body["input_ids"])
        if len(answers) == 1:  # in flight when the push starts: aborted by it
            client.interrupt()
            return {"meta_info": {"finish_reason": {"type": "abort"}, "completion_tokens": 2}}
        if len(answers) == 2:  # the restart, sent during the push: aborted by the pause's next round,
            client.end_interrupt()  # its answer arriving once the push is over
            return {"meta_info": {"finish_reason": {"type": "abort"}, "completion_tokens": 0}}
        return {"output_ids": [5, 6], "meta_info": {"output_token_logprobs": [[-0.5, 5, None], [-0.25, 6, None]],
                                                    "finish_reason": {"type": "stop"}, "weight_version": "v"}}

    client._post = post
    [rollout] = client.generate([[1, 2, 3]], PARAMS)
    assert rollout.response_ids == [5, 6] and len(answers) == 3 and client.tokens_regenerated == 2
    # Once the push is over, an abort is the server's: it uses an attempt.
    answers.clear()
    answers.append(None)  # the next answer is the second kind: an abort, no push under way
    with pytest.raises(RolloutError, match="failed after 1 attempts"):
        client.generate([[1, 2, 3]], PARAMS)


class HeldServer:
    """A /generate stand-in on an event loop of its own (one thread, whatever it holds): each request
    is held until `release()` (or answered at once with HTTP 400 when its prompt starts with 0);
    it counts the requests held, their peak, and those whose client hung up while held."""

    ANSWER = json.dumps({"output_ids": [5, 6], "meta_info": {
        "output_token_logprobs": [[-0.5, 5, None], [-0.25, 6, None]], "finish_reason": {"type": "stop"},
        "weight_version": "v"}}).encode()

    def __init__(self):
        import asyncio

        self.asyncio, self.held, self.peak, self.gone = asyncio, 0, 0, 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.released = self._on_loop(self._event())
        self.server = self._on_loop(asyncio.start_server(self._connection, "127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _event(self):
        return self.asyncio.Event()

    def _on_loop(self, coroutine):
        return self.asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def release(self):
        self.loop.call_soon_threadsafe(self.released.set)

    def close(self):
        self._on_loop(self._shutdown())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()

    async def _shutdown(self):
        self.server.close()
        connections = self.asyncio.all_tasks() - {self.asyncio.current_task()}
        for connection in connections:
            connection.cancel()
        await self.asyncio.gather(*connections, return_exceptions=True)

    async def _connection(self, reader, writer):
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode()
                length = int(next(line.split(":")[1] for line in head.split("\r\n")
                                  if line.lower().startswith("content-length")))
                body = json.loads(await reader.readexactly(length))
                status, answer = "200 OK", b"{}"
                if head.startswith("POST /generate") and body["input_ids"][0] == 0:
                    status, answer = "400 Bad Request", b'{"message": "prompt 0 refused"}'
                elif head.startswith("POST /generate"):
                    answer = self.ANSWER
                    if not await self._hold(reader):
                        return
                writer.write(f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
                             f"Content-Length: {len(answer)}\r\n\r\n".encode() + answer)
                await writer.drain()
        except (self.asyncio.IncompleteReadError, ConnectionError, self.asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def _hold(self, reader) -> bool:
        """Until released (True) or the client hangs up (False)."""
        self.held += 1
        self.peak = max(self.peak, self.held)
        hung_up = self.asyncio.ensure_future(reader.read(1))
        released = self.asyncio.ensure_future(self.released.wait())
        try:
            await self.asyncio.wait([hung_up, released], return_when=self.asyncio.FIRST_COMPLETED)
        finally:
            self.held -= 1
            for waiter in (hung_up, released):
                waiter.cancel()
            await self.asyncio.gather(hung_up, released, return_exceptions=True)
        if not hung_up.cancelled():
            self.gone += 1
            return False
        return True


@pytest.fixture
def held_server():
    server = HeldServer()
    yield server
    server.close()


def _until(condition, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert condition()


def test_callers_share_one_bound_on_the_requests_in_flight(held_server):
    """Threads calling generate() at once, and coroutines of another event loop: never more than
    max_concurrency requests in flight over all of them (what the servers run together)."""
    import asyncio

    client = SGLangClient([held_server.url], 256, max_concurrency=8)
    results = {}

    def call(k):
        results[k] = client.generate([[k, i, 1] for i in range(10)], PARAMS)

    async def turns():
        return await asyncio.gather(*(client.generate_one_async(f"t{i}", [9, i], PARAMS, 0) for i in range(10)))

    threads = [threading.Thread(target=call, args=(k,)) for k in (1, 2, 3)]
    threads.append(threading.Thread(target=lambda: results.update(turns=asyncio.run(turns()))))
    for thread in threads:
        thread.start()
    _until(lambda: held_server.held == 8)
    time.sleep(0.3)  # none beyond the bound arrives
    assert held_server.peak == 8
    held_server.release()
    for thread in threads:
        thread.join(30)
    assert held_server.peak == 8 and len(results) == 4
    assert [r.prompt_ids for r in results[2]] == [[2, i, 1] for i in range(10)]
    assert all(r.response_ids == [5, 6] for r in results["turns"])


def test_requests_in_flight_take_no_thread_each(held_server):
    client = SGLangClient([held_server.url], 256, max_concurrency=256)
    before = threading.active_count()
    results = {}
    prompts = [[1, i] for i in range(200)]
    caller = threading.Thread(target=lambda: results.update(rollouts=client.generate(prompts, PARAMS)))
    caller.start()
    _until(lambda: held_server.held == 200)
    assert threading.active_count() <= before + 2  # the caller and the client's event loop
    held_server.release()
    caller.join(30)
    assert len(results["rollouts"]) == 200


def test_a_failed_request_cancels_the_rest_of_its_call(held_server):
    """A request the server refuses fails the call at once, naming it; the call's other requests
    are cancelled (their connections closed), not left running on the servers."""
    client = SGLangClient([held_server.url], 256, max_concurrency=32)
    started = time.monotonic()
    prompts = [[i + 1, 2] for i in range(9)]
    caller = threading.Thread(target=lambda: client.generate(prompts, PARAMS))
    with pytest.raises(RolloutError, match="refused the request: HTTP 400: prompt 0 refused"):
        caller.start()
        _until(lambda: held_server.held == 9)
        client.generate(prompts + [[0, 1]], PARAMS)  # 9 more held, then the refused one
    assert time.monotonic() - started < 10
    _until(lambda: held_server.gone == 9 and held_server.held == 9)  # the failed call's, gone; the other's, held
    held_server.release()
    caller.join(30)


def test_close_while_requests_are_in_flight_returns_promptly(held_server):
    """The servers keep the requests (an abort they ignore): close() still returns at once, and the
    callers get the closed client's error."""
    client = SGLangClient([held_server.url], 256, max_concurrency=64)
    errors = []

    def call():
        try:
            client.generate([[1, i] for i in range(50)], PARAMS)
        except RolloutError as err:
            errors.append(str(err))

    callers = [threading.Thread(target=call) for _ in range(2)]
    for caller in callers:
        caller.start()
    _until(lambda: held_server.held == 64)
    started = time.monotonic()
    client.close()
    for caller in callers:
        caller.join(10)
    assert time.monotonic() - started < 5 and not any(c.is_alive() for c in callers)
    assert len(errors) == 2 and all(re.fullmatch(r"request \d+: the client was closed", e) for e in errors)
    with pytest.raises(RolloutError, match="request 0: the client was closed"):
        client.generate([[1, 2]], PARAMS)


def test_evaluation_requests_take_the_next_free_slot_before_waiting_training_ones():
    """An evaluation (and the trainer waiting on it) queued behind every training request the
    asynchronous producer had admitted; now it goes first."""
    import asyncio

    from gspo_mcore.engines.client import Slots

    async def scenario():
        slots, order = Slots(1), []
        await slots.acquire()

        async def request(name, first=False):
            await slots.acquire(first)
            order.append(name)
            await asyncio.sleep(0)
            slots.release()

        waiting = [asyncio.ensure_future(request(f"train-{i}")) for i in range(3)]
        await asyncio.sleep(0)
        waiting.append(asyncio.ensure_future(request("eval", first=True)))
        cancelled = asyncio.ensure_future(request("cancelled", first=True))
        await asyncio.sleep(0)
        cancelled.cancel()  # a waiter cancelled in the queue gives up its place, not a slot
        await asyncio.sleep(0)
        slots.release()
        await asyncio.gather(*waiting)
        return order, slots.free

    order, free = asyncio.run(scenario())
    assert order == ["eval", "train-0", "train-1", "train-2"] and free == 1


def test_the_client_sends_each_request_on_a_connection_of_its_own():
    """SGLang's and vLLM's servers close a keep-alive connection idle for 5 s; the client's loop,
    starved by the training step under rank 0's GIL, could send on one the server had closed:
    7 to 36 requests per step were retried in the vLLM async test. No connection is reused."""
    import asyncio

    from gspo_mcore.common.http_async import open_session

    async def reuses() -> bool:
        session = open_session()
        try:
            return not session.connector.force_close
        finally:
            await session.close()

    assert not asyncio.run(reuses())
