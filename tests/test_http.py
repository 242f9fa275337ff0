"""The JSON-over-HTTP helper and its callers' error kinds, against a tiny local server that
answers JSON, text, 4xx/5xx, or dies in the middle of its answer."""

import json
import os
import subprocess
import sys
import time

import pytest

from gspo_mcore.common.errors import InputError
from gspo_mcore.common.netaddr import free_port
from gspo_mcore.engines.client import RetryableError
from gspo_mcore.engines.sglang.client import SGLangClient
from gspo_mcore.common.errors import WeightSyncError
from gspo_mcore.engines.sglang.engine import SGLangEngine
from gspo_mcore.common.http import ConnectionFailure, HTTPStatusError, get_json, post_json
from helpers import REPO, ToyHandler, toy_server, url as server_url
from gspo_mcore.common.errors import RolloutError

LONG = "m" * 1000
OPENAI_MESSAGE = ("Requested token count exceeds the model's maximum context length of 512 tokens. You requested a "
                  "total of 563 tokens: 307 tokens from the input messages and 256 tokens for the completion. Please "
                  "reduce the number of tokens in the input messages or the completion to fit within the limit.")


class Handler(ToyHandler):
    def do_GET(self):
        self.received = None
        self._route()

    def do_POST(self):
        self.received = self.rfile.read(int(self.headers["Content-Length"]))
        self._route()

    def _route(self):
        routes = {
            "/echo": lambda: self.json(200, {"method": self.command, "type": self.headers.get("Content-Type"),
                                              "body": json.loads(self.received) if self.received else None}),
            "/auth": lambda: self.json(200, {"authorization": self.headers.get("Authorization")}),
            "/flush_cache": lambda: self.answer(200, b"Cache flushed.\n", length=15),  # SGLang: no Content-Type
            "/refused": lambda: self.json(400, {"object": "error", "message": "outside a weight-update session"}),
            "/refused_long": lambda: self.json(400, {"message": LONG}),
            "/refused_openai": lambda: self.json(400, {"error": {"message": OPENAI_MESSAGE, "type": "BadRequest"}}),
            "/refused_text": lambda: self.answer(404, b"Not Found", "text/plain", 9),
            "/busy": lambda: self.json(503, {"error": "busy"}),
            "/failed": lambda: self.json(200, {"success": False, "message": "shape mismatch"}),
            "/get_server_info": lambda: self.json(200, {"tp_size": 2, "max_running_requests": 48,
                                                         "max_total_num_tokens": 100_000}),
            "/abort_request": lambda: (ABORTS.append(json.loads(self.received)), self.json(200, {})),
            # Dies mid-answer: fewer bytes than promised (IncompleteRead) ...
            "/cut_short": lambda: self.answer(200, b'{"output_ids": [1,', "application/json", 100),
            # ... or, with no length given, a JSON body that just stops.
            "/cut_open": lambda: self.answer(200, b'{"output_ids": [1,', "application/json"),
        }
        routes[self.path.removesuffix("/generate")]()  # the generate client's server is url/<route>


@pytest.fixture(scope="module")
def url():
    with toy_server(Handler) as server:
        yield server_url(server)


ABORTS = []  # what /abort_request received


def test_json_post_and_get(url):
    assert post_json(f"{url}/echo", {"a": [1, 2]}, 5) == {"method": "POST", "type": "application/json",
                                                           "body": {"a": [1, 2]}}
    assert get_json(f"{url}/echo", 5) == {"method": "GET", "type": None, "body": None}


def test_the_run_api_key_goes_with_every_request(url, monkeypatch):
    from gspo_mcore.engines.sglang.client import SGLangClient
    from gspo_mcore.common.http import API_KEY_ENV

    monkeypatch.setenv(API_KEY_ENV, "from-the-environment")  # read once by entry points, never here
    assert get_json(f"{url}/auth", 5) == {"authorization": None}
    assert get_json(f"{url}/auth", 5, api_key="k3y") == {"authorization": "Bearer k3y"}
    assert post_json(f"{url}/auth", {}, 5, api_key="k3y") == {"authorization": "Bearer k3y"}
    assert SGLangEngine([url], api_key="k3y").call(url, "/auth") == {"authorization": "Bearer k3y"}
    client = SGLangClient([url], 256, api_key="k3y")
    assert client.run(client._post(f"{url}/auth", {})) == {"authorization": "Bearer k3y"}


def test_a_server_for_other_hosts_needs_an_api_key(monkeypatch):
    """`python -m gspo_mcore.engines.serve` binds 127.0.0.1 by default; 0.0.0.0 without a key
    is refused (anyone reaching /update_weights_* could load weights into it)."""
    import pytest as _pytest

    from gspo_mcore.common.errors import InputError
    from gspo_mcore.common.http import API_KEY_ENV
    from gspo_mcore.engines.serve import main

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    with _pytest.raises(InputError, match=f"--host 0.0.0.0: a server other hosts can reach needs an API key in {API_KEY_ENV}"):
        main(["--config", "configs/tiny_cpu.yaml", "--port", "1", "--host", "0.0.0.0"])


def test_text_answer_comes_back_as_text(url):
    assert post_json(f"{url}/flush_cache", None, 5) == "Cache flushed.\n"


def test_refusal_keeps_status_and_sglang_message(url):
    with pytest.raises(HTTPStatusError) as err:
        post_json(f"{url}/refused", {}, 5)
    assert err.value.status == 400 and err.value.detail == "outside a weight-update session"
    assert str(err.value) == "HTTP 400: outside a weight-update session"
    with pytest.raises(HTTPStatusError) as err:
        post_json(f"{url}/refused_long", {}, 5)
    assert err.value.detail == LONG  # an engine's message is quoted whole (it was cut at 300 characters)
    with pytest.raises(HTTPStatusError) as err:
        post_json(f"{url}/refused_openai", {}, 5)
    assert err.value.detail == OPENAI_MESSAGE
    with pytest.raises(HTTPStatusError) as err:
        get_json(f"{url}/refused_text", 5)
    assert err.value.status == 404 and err.value.detail == "Not Found"
    with pytest.raises(HTTPStatusError) as err:
        post_json(f"{url}/busy", {}, 5)
    assert err.value.status == 503


@pytest.mark.parametrize("path", ["/cut_short", "/cut_open"])
def test_answer_cut_off_is_a_connection_failure(url, path):
    with pytest.raises(ConnectionFailure):
        post_json(f"{url}{path}", {}, 5)


def test_connection_refused_is_a_connection_failure():
    with pytest.raises(ConnectionFailure, match="URLError"):
        post_json(f"http://127.0.0.1:{free_port()}/generate", {}, 5)


# The callers keep their own error kinds on top of the helper's.

def test_generate_client_errors(url):
    client = SGLangClient([url], 256)
    with pytest.raises(RolloutError, match=f"server {url}/refused refused the request: HTTP 400: outside a weight"):
        client.run(client._post(f"{url}/refused", {}))
    for route, message in [("/busy", "HTTP 503"), ("/cut_short", "IncompleteRead"),
                           ("/cut_open", "JSONDecodeError"), ("/flush_cache", "not a /generate answer")]:
        with pytest.raises(RetryableError, match=message):
            client.run(client._post(f"{url}{route}", {}))
    with pytest.raises(RetryableError, match="URLError"):
        client.run(client._post(f"http://127.0.0.1:{free_port()}", {}))


def test_engine_control_errors(url):
    control = SGLangEngine([url], timeout_s=5)
    assert control.call(url, "/flush_cache") == {"text": "Cache flushed.\n"}
    assert control.tp_size(url) == 2
    with pytest.raises(WeightSyncError, match=f"^server {url}/refused: HTTP 400: outside a weight-update session$"):
        control.call(url, "/refused")
    with pytest.raises(WeightSyncError, match=f"^server {url}/failed: shape mismatch$"):
        control.call(url, "/failed")
    with pytest.raises(WeightSyncError, match=f"^server {url}/cut_short: IncompleteRead"):
        control.call(url, "/cut_short")
    gone = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(WeightSyncError, match=f"^server {gone}/get_server_info: URLError"):
        control.tp_size(gone)


def test_serve_help_shows_the_host_default():
    proc = subprocess.run([sys.executable, "-m", "gspo_mcore.engines.serve", "--help"], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert proc.returncode == 0 and "default: 127.0.0.1" in " ".join(proc.stdout.split())


def test_a_server_log_never_holds_the_api_key(tmp_path):
    """SGLang logs its arguments, the API key among them: the log a run keeps has it redacted,
    also for output that arrives before the server is healthy and output after."""
    from gspo_mcore.common.processes import ManagedServer, start_redacted

    script = "import sys, time; print('server_args=api_key=s3cret-k3y port=1', flush=True); time.sleep(30)"
    # 4 s: enough for the interpreter to start and print under a loaded suite (it was 8: half the test).
    with pytest.raises(InputError, match="not healthy"):
        with ManagedServer([sys.executable, "-c", script], "http://127.0.0.1:9", tmp_path / "server.log",
                           startup_timeout_s=4, secrets=("s3cret-k3y",)):
            pass
    assert _eventually(tmp_path / "server.log") == "server_args=api_key=<redacted> port=1\n"
    with open(tmp_path / "plain.log", "wb") as out:  # open until the copying thread wrote (as a server's log is)
        start_redacted([sys.executable, "-c", "print('a s3cret-k3y b')"], out, ("s3cret-k3y",)).wait()
        assert _eventually(tmp_path / "plain.log") == "a <redacted> b\n"


def _eventually(path, timeout_s: float = 10.0) -> str:
    """The file's text once something is in it (the copying thread drains the pipe)."""
    deadline = time.monotonic() + timeout_s
    while not path.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    return path.read_text()


def test_the_rollout_client_keeps_as_many_requests_in_flight_as_the_servers_run(url):
    """Concurrency from the servers' own limits (a fixed 64 left 256-request servers mostly idle)."""
    control = SGLangEngine([url])
    assert control.tp_size(url) == 2 and control.capacity(url, 64) == 48


def test_no_more_requests_in_flight_than_the_servers_kv_cache_holds(url):
    """A 30B async config ran 256 requests per server against a KV pool that held ~30 at full
    length: the rest queued (and were retracted to the back at each push) while their timeout ran."""
    control = SGLangEngine([url])
    assert control.capacity(url, 64, request_tokens=1000) == 48  # the pool holds 100 such requests
    assert control.capacity(url, 64, request_tokens=8704) == 11  # 100,000 // (512 + 8192)


def test_a_closed_client_aborts_what_is_in_flight_and_retries_nothing(url):
    """An asynchronous producer's client at the end of a run: the servers abort its requests (so
    its waiting threads return) and nothing is sent again."""
    client = SGLangClient([url], 256, max_attempts=5, backoff_s=10)
    client.close()
    assert ABORTS[-1] == {"rid": "", "abort_all": True}
    started = time.monotonic()
    with pytest.raises(RolloutError, match="request 0: the client was closed"):
        client.generate([[1, 2, 3]], {"max_new_tokens": 4})
    assert time.monotonic() - started < 1


_FLAKY_SERVER = """
import http.server, os, signal, sys
marker, port = sys.argv[1], int(sys.argv[2])
if not os.path.exists(marker):
    open(marker, "w").close()
    print("Scheduler hit an exception: RuntimeError: the port was taken", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # as SGLang's launcher takes its own tree down
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def test_a_server_killed_while_starting_is_started_once_more(tmp_path):
    """SGLang's launcher SIGKILLs its tree when a worker fails to initialise (a port another process
    took in the meantime, in CI): one more start, said on stderr, and the server is up."""
    from gspo_mcore.common.netaddr import free_port
    from gspo_mcore.common.processes import ManagedServer

    port = free_port()
    cmd = [sys.executable, "-c", _FLAKY_SERVER, str(tmp_path / "started-once"), str(port)]
    with ManagedServer(cmd, f"http://127.0.0.1:{port}", tmp_path / "server.log", startup_timeout_s=30) as server:
        assert server.healthy()
    assert "the port was taken" in (tmp_path / "server.log").read_text()


def test_a_server_that_fails_on_its_input_is_not_retried_and_says_why(tmp_path):
    from gspo_mcore.common.processes import ManagedServer

    script = "import sys; print('ValueError: no config.json in /models/x', flush=True); sys.exit(1)"
    with pytest.raises(InputError, match=r"exited with code 1 while starting \(ValueError: no config.json in /models/x\)"):
        ManagedServer([sys.executable, "-c", script], "http://127.0.0.1:9", tmp_path / "s.log").start()
    assert (tmp_path / "s.log").read_text().count("ValueError") == 1


def test_a_server_whose_port_was_taken_is_started_again_not_waited_on(tmp_path):
    """SGLang logs 'address already in use' and keeps its scheduler alive: it never exits nor
    answers, and the test suite waited its whole start-up timeout (300 s) for it."""
    from gspo_mcore.common.processes import ManagedServer, ServerStartError

    script = ("import time; print(\"ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 9): "
              "address already in use\", flush=True); time.sleep(60)")
    began = time.monotonic()
    with pytest.raises(ServerStartError, match="could not bind its port") as err:
        ManagedServer([sys.executable, "-c", script], "http://127.0.0.1:9", tmp_path / "server.log",
                      startup_timeout_s=120).start()
    assert err.value.transient and time.monotonic() - began < 30  # tried twice, both at once
    # A second start reads only its own lines: the first's refusal does not fail a start that binds.
    server = ManagedServer([sys.executable, "-c", "import time; time.sleep(60)"], "http://127.0.0.1:9",
                           tmp_path / "server.log", startup_timeout_s=3)
    with pytest.raises(InputError, match="not healthy after 3 s"):
        server.start()


_BINDING_SERVER = """
import http.server, sys, time
port = int(sys.argv[1])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a):
        pass
try:
    server = http.server.HTTPServer(("127.0.0.1", port), H)
except OSError as exc:  # as SGLang: logged, and the process lives on without answering
    print(f"ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', {port}): {exc}", flush=True)
    time.sleep(60)
server.serve_forever()
"""


def test_a_port_another_process_holds_is_given_up_for_a_new_one(tmp_path):
    """Two processes drew the same free port (free_port() closes its socket before the server
    binds): the other one kept it, and the retry on the same port failed again (the suite, CI-like,
    2026-11-28: an async run exited 2). The retry now asks for the command on a new port."""
    import socket

    from gspo_mcore.common.processes import ManagedServer, ServerStartError

    # Bound, not listening: a health check is refused at once (one listening but never answering
    # would hold each check for its 5 s timeout).
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        command = lambda p: [sys.executable, "-c", _BINDING_SERVER, str(p)]  # noqa: E731
        with ManagedServer(command(port), f"http://127.0.0.1:{port}", tmp_path / "server.log", startup_timeout_s=30,
                           command_for_port=command) as server:
            assert server.healthy() and server.url != f"http://127.0.0.1:{port}"
        assert "address already in use" in (tmp_path / "server.log").read_text().lower()
        # The factory pairs the port it draws with the URL (and keeps the command for a retry).
        with ManagedServer.on_free_port(command, tmp_path / "free.log", startup_timeout_s=30) as server:
            assert server.healthy() and server.url == f"http://127.0.0.1:{server.cmd[-1]}"
            assert server.command_for_port is command
        # Without the command for another port, the retry goes to the same one, and fails.
        with pytest.raises(ServerStartError, match="could not bind its port"):
            ManagedServer(command(port), f"http://127.0.0.1:{port}", tmp_path / "again.log",
                          startup_timeout_s=30).start()


def test_a_second_stop_does_not_signal_the_old_process_group_again(tmp_path, monkeypatch):
    """Once the group is gone the kernel gives its id to a new process (a sandbox's bwrap, say,
    which would die without a word)."""
    from gspo_mcore.common.processes import ManagedServer

    server = ManagedServer([sys.executable, "-c", "import time; time.sleep(60)"], "http://127.0.0.1:9",
                           tmp_path / "server.log").launch()
    server.stop(grace_s=5)
    signalled = []
    monkeypatch.setattr(os, "killpg", lambda pgid, sig: signalled.append((pgid, sig)))
    server.stop(grace_s=5)
    assert signalled == []
