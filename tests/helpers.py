"""What the tests share, in one place: the repository, the environment of the processes they
start, running a module or a training run and reaping what it started, a run's metrics, toy HTTP
servers and a scripted generation client. Test modules import from here (and take conftest's
fixtures), never from one another."""

import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import pytest

if TYPE_CHECKING:
    from gspo_mcore.rollout.source import RolloutSource

REPO = Path(__file__).resolve().parent.parent
CPU_DEFAULT = "configs/tiny_cpu.yaml"
HF_30B = REPO / "configs/hf/qwen3-30b-a3b.config.json"
HF_235B = REPO / "configs/hf/qwen3-235b-a22b.config.json"
GIB = 1024**3
# Every GPU config in configs/ (a new one must be added here): nodes, the model's config.json.
GPU_CONFIGS = {
    "qwen3_30b_a3b_gspo.yaml": (1, HF_30B),
    "qwen3_30b_a3b_gspo_2node.yaml": (2, HF_30B),
    "qwen3_30b_a3b_gspo_async.yaml": (2, HF_30B),  # split: 8 trainer GPUs, 8 SGLang GPUs
    "qwen3_30b_a3b_gspo_async_1node.yaml": (1, HF_30B),  # split on one node: 4 + 4
    "qwen3_30b_a3b_gspo_tools.yaml": (1, HF_30B),  # multi-turn with a Python tool
    "qwen3_30b_a3b_gspo_code.yaml": (1, HF_30B),  # code RL (the sandbox reward)
    "qwen3_30b_a3b_gspo_vllm.yaml": (1, HF_30B),  # vLLM colocated, weights through CUDA IPC
    "qwen3_30b_a3b_gspo_async_1node_vllm.yaml": (1, HF_30B),  # vLLM, async, weights over NCCL
    "qwen3_235b_a22b_gspo.yaml": (16, HF_235B),
}


# ------------------------------------------------------------ child processes
def environment(warnings: bool = False, **extra: str) -> dict[str, str]:
    """The environment of a process a test starts: this checkout importable, one OpenMP thread
    (three workers share two cores: conftest says why) and, unless `warnings`, Python's warnings
    off (a user's run shows them; the tests read the output, not the noise); `extra` added."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **extra}
    if warnings:
        del env["PYTHONWARNINGS"]
    return env


def run_module(args: list[str], nproc: int = 1, timeout: int = 300, warnings: bool = False) -> subprocess.CompletedProcess:
    """Run `python ARGS` (nproc 1) or `torchrun --nproc_per_node N ARGS`; fail with its log.
    `warnings`: Python's own warning display, as a user runs it."""
    if nproc == 1:
        cmd = [sys.executable, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
               *args]
    # Output through files, not pipes: a daemon the job leaves behind (torch_shm_manager, kept
    # by a server that mapped shared tensors) would hold a pipe open and block the read.
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        returncode = subprocess.run(cmd, stdout=out, stderr=err, text=True, timeout=timeout,
                                    env=environment(warnings), cwd=REPO).returncode
        out.seek(0), err.seek(0)
        proc = subprocess.CompletedProcess(cmd, returncode, out.read(), err.read())
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def captured(cmd: list[str], timeout: int = 600, **extra: str) -> subprocess.CompletedProcess:
    """`cmd` to its end from the repository, with `environment(**extra)`, its output captured as
    text; the caller checks the exit code (a test of a failure expects one)."""
    return subprocess.run(cmd, cwd=REPO, env=environment(**extra), capture_output=True, text=True, timeout=timeout)


def last_json_line(text: str) -> dict:
    return json.loads([line for line in text.splitlines() if line.startswith("{")][-1])


# ------------------------------------------------------------ training runs
def toy_overrides(toy: Path, evaluate: bool = False) -> list[str]:
    """The toy task's paths (conftest's `toy`); the config's evaluation only when asked (it adds
    to every run)."""
    dataset = f"[{{name: toy, path: {toy / 'eval.jsonl'}, samples: 4, max_new_tokens: 3}}]" if evaluate else "[]"
    return [f"model.hf_dir={toy / 'model'}", f"data.path={toy / 'prompts.jsonl'}", f"eval.datasets={dataset}"]


def _train_args(out: Path, args, config: str) -> list[str]:
    return ["-m", "gspo_mcore.train", "--config", config, "--output-dir", str(out), *args]


def train_command(out: Path, args=(), nproc: int = 1, config: str = CPU_DEFAULT) -> list[str]:
    """`gspo-train` into `out` as a user starts it (through gspo_mcore.run.torchrun for several ranks),
    for a run the test signals or watches (`start`)."""
    launcher = ["-m", "gspo_mcore.run.torchrun", "--standalone", "--nproc_per_node", str(nproc)] if nproc > 1 else []
    return [sys.executable, *launcher, *_train_args(out, args, config)]


def train(out: Path, overrides, nproc: int = 1, config: str = CPU_DEFAULT, extra=(), timeout: int = 900,
          warnings: bool = False) -> subprocess.CompletedProcess:
    """A whole run to its end (`extra`: arguments before the overrides, e.g. --resume); the test
    fails with its log if it does not exit 0."""
    return run_module(_train_args(out, [*extra, *overrides], config), nproc=nproc, timeout=timeout, warnings=warnings)


def metrics(out: Path) -> list[dict]:
    """A run's metrics.jsonl, one dict per step written."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def start(cmd: list[str], log: Path | None = None, **popen) -> subprocess.Popen:
    """A process the test stops itself (pair with `reaped`), from the repository with `environment()`
    unless `popen` says otherwise; its output into `log` (stdout and stderr together) when given."""
    options = {"cwd": REPO, "env": environment(), **popen}
    if log is None:
        return subprocess.Popen(cmd, **options)
    with open(log, "w") as output:
        return subprocess.Popen(cmd, stdout=output, stderr=subprocess.STDOUT, **options)


def wait_for_rows(proc: subprocess.Popen, out: Path, rows: int, log: Path | None = None, timeout_s: float = 400) -> None:
    """Until the run in `out` wrote `rows` steps to metrics.jsonl; fails (with the log's tail) if it
    exits or takes longer first."""
    deadline, written = time.monotonic() + timeout_s, out / "metrics.jsonl"
    while not (written.is_file() and len(written.read_text().splitlines()) >= rows):
        if proc.poll() is not None or time.monotonic() > deadline:
            said = log.read_text()[-3000:] if log is not None else ""
            pytest.fail(f"the run did not reach step {rows} (exit code {proc.poll()})\n{said}")
        time.sleep(0.3)


def descendants(proc: subprocess.Popen) -> list:
    import psutil

    return psutil.Process(proc.pid).children(recursive=True)


def kill_and_reap(proc: subprocess.Popen, sig: int = signal.SIGKILL, children: list | None = None,
                  timeout_s: float = 60) -> str | None:
    """Send `sig` to `proc` (its pid only: what it started must go by itself), wait for it and
    assert that none of `children` (default: its descendants just before) outlives it by 30 s.
    Returns what it wrote to its pipe (stdout, else stderr; None without one), read while waiting:
    a full pipe would block its exit. Its exit code is `proc.returncode`."""
    import psutil

    children = descendants(proc) if children is None else children
    os.kill(proc.pid, sig)
    output, errors = proc.communicate(timeout=timeout_s)
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, [(p.pid, p.cmdline()) for p in alive]
    return output if output is not None else errors


@contextmanager
def reaped(proc: subprocess.Popen) -> Iterator[subprocess.Popen]:
    """`proc`, SIGKILLed on the way out if still running (its process group when it leads one),
    so a failing test leaves nothing behind."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            if os.getpgid(proc.pid) == proc.pid:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()
            proc.wait()


# ------------------------------------------------------------ toy HTTP servers
class ToyHandler(BaseHTTPRequestHandler):
    """An HTTP stand-in's handler: quiet, with the answers a JSON server gives."""

    def log_message(self, *args):
        pass

    def body(self):
        """The request's JSON (None when it has none)."""
        return json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"null")

    def answer(self, code: int, data: bytes, content_type: str | None = None, length: int | None = None) -> None:
        """`length`: the Content-Length said (none when None), which may differ from the bytes sent."""
        self.send_response(code)
        if content_type:
            self.send_header("Content-Type", content_type)
        if length is not None:
            self.send_header("Content-Length", str(length))
        self.end_headers()
        self.wfile.write(data)

    def json(self, code: int, payload) -> None:
        data = json.dumps(payload).encode()
        self.answer(code, data, "application/json", len(data))

    def text(self, code: int, text: str) -> None:
        """Plain bytes with no Content-Type, as SGLang's text answers."""
        data = text.encode()
        self.answer(code, data, length=len(data))


@contextmanager
def toy_server(handler: type[BaseHTTPRequestHandler]) -> Iterator[ThreadingHTTPServer]:
    """`handler` served on a free local port from a thread, for the block; `url(server)` reaches it."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def url(server: ThreadingHTTPServer) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


# ------------------------------------------------------------ a scripted generation client
class ScriptedClient:
    """The rollout client's `generate_one` / `generate_one_async`, as the tool loop, rollout
    functions and the evaluator call them: each call answers `reply(name, prompt_ids)`'s text,
    tokenized, with the end-of-turn token, cut at max_new_tokens; log-probs `logprob` each, the
    weight version asked for (step-0 when none), every token of version 0. `calls`: (name, server,
    weight_version) per call; `inputs`: the prompts."""

    def __init__(self, tokenizer, reply, urls=("scripted",), max_concurrency: int = 4, logprob: float = -0.1):
        self.tokenizer, self.reply, self.logprob = tokenizer, reply, logprob
        self.urls, self.max_concurrency = list(urls), max_concurrency
        self.calls, self.inputs = [], []

    @classmethod
    def replying(cls, tokenizer, replies, **options) -> "ScriptedClient":
        """Answers `replies` in order, one a call."""
        replies = list(replies)
        return cls(tokenizer, lambda name, prompt_ids: replies.pop(0), **options)

    async def generate_one_async(self, *request, evaluation=False):
        return self.generate_one(*request)

    def generate_one(self, name, prompt_ids, params, server, weight_version=None, oldest_version=None):
        from gspo_mcore.batch.rollout import Rollout

        self.calls.append((name, server, weight_version))
        self.inputs.append(list(prompt_ids))
        text = self.reply(name, list(prompt_ids))
        ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        ids = ids[: params["max_new_tokens"]]
        finish = "stop" if ids[-1] == self.tokenizer.eos_token_id else "length"
        return Rollout(list(prompt_ids), ids, [self.logprob] * len(ids), finish, weight_version or "step-0",
                       token_versions=(0,) * len(ids))


# ------------------------------------------------------------ a scripted engine of the toy task
# A rollout source's whole-batch `generate` (ScriptedClient is one request's).
GROUP = 4


class ScriptedEngine:
    """A prompt asking for a color gets a right answer from its even members only (a group with
    signal); every other prompt gets a wrong answer from all members (no signal)."""

    def __init__(self, tokenizer, delay_s: float = 0.0):
        from gspo_mcore.engines.client import BusyClock

        self.tokenizer, self.delay_s = tokenizer, delay_s
        self.calls = []  # (categories asked, seeds) per generate call
        self.params = []  # the sampling parameters of each call
        self.version = 0  # the weights it generates with (the producer tests move it)
        self.clock, self.tokens_regenerated, self.closed = BusyClock(["scripted"]), 0, False
        self.requests_retried = 0

    def close(self):
        self.closed = True

    def interrupt(self):
        pass

    def end_interrupt(self):
        pass

    def generate(self, prompts, params, weight_version=None, seeds=None, oldest_version=None, evaluation=False):
        from gspo_mcore.batch.rollout import Rollout

        version = self.version
        self.clock.started("scripted")
        time.sleep(self.delay_s)
        self.clock.started("scripted", -1)
        categories = [re.search(r"name an? (\w+)", self.tokenizer.decode(p)).group(1) for p in prompts]
        self.calls.append((categories, seeds))
        self.params.append(params)
        out = []
        for i, (prompt, category) in enumerate(zip(prompts, categories)):
            right = category == "color" and i % GROUP % 2 == 0
            word = f"{category}_0" if right else ("animal_0" if category == "color" else "color_0")
            ids = self.tokenizer.convert_tokens_to_ids([word, "<eos>"])
            # Generated across a version change when one happened while it ran.
            out.append(Rollout(prompt, ids, [-1.0, -0.5], "stop", weight_version or f"step-{self.version}",
                               token_versions=(version, self.version)))
        return out


def source_for(task: Path, *extra, **options) -> tuple["RolloutSource", ScriptedEngine]:
    """A rollout source of the toy task in `task` (its tokenizer/ and prompts.jsonl) on a scripted
    engine. options: train.rollout_batch_size, or a rollout field (sampling); extra: more overrides."""
    from gspo_mcore.config import load_config
    from gspo_mcore.rollout.source import RolloutSource

    overrides = [f"data.path={task / 'prompts.jsonl'}", f"data.tokenizer_dir={task / 'tokenizer'}",
                 "reward.name=gspo_mcore.tasks.toy:category_reward", "reward.workers=1", f"train.group_size={GROUP}",
                 *(f"{'train' if k == 'rollout_batch_size' else 'rollout'}.{k}={v}" for k, v in options.items()),
                 "reward.norm=group", *extra]
    source = RolloutSource(load_config(None, overrides))
    source.client = engine = ScriptedEngine(source.tokenizer)
    return source, engine


# ------------------------------------------------------------------ a stand-in libnccl
# ncclResult_t codes (nccl.h) and what NCCL 2.30's ncclGetErrorString says for them.
ERRORS = {1: b"unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
          2: b"unhandled system error (run with NCCL_DEBUG=INFO for details)",
          3: b"internal error - please report this issue to the NCCL developers",
          4: b"invalid argument (run with NCCL_DEBUG=WARN for details)",
          5: b"invalid usage (run with NCCL_DEBUG=WARN for details)",
          6: b"remote process exited or there was a network error"}


class FakeNCCL:
    """A stand-in for the CDLL: each function records its call and returns `codes[name]` (0 if
    unset); ncclGetUniqueId writes `uid`; ncclCommInitRank hands out handle 0x1000."""

    def __init__(self, codes=None, last_error=b"", uid=bytes(range(128, 256)), missing=()):
        self.codes, self.calls, self.last_error, self.uid = dict(codes or {}), [], last_error, uid
        from gspo_mcore.engines.vllm import nccl_library

        for name, _, _ in nccl_library.FUNCTIONS:
            if name not in missing:
                setattr(self, name, self._function(name))

    def _function(self, name):
        def function(*args):
            self.calls.append((name, args))
            return getattr(self, f"_{name}", lambda *a: self.codes.get(name, 0))(*args)
        return function

    def _ncclGetErrorString(self, code):
        return ERRORS.get(code, b"unknown result code")

    def _ncclGetLastError(self, comm):
        return self.last_error

    # The library writes through the pointers it is given (ctypes.byref: the object is `_obj`).
    def _ncclGetVersion(self, out):
        out._obj.value = 23007
        return self.codes.get("ncclGetVersion", 0)

    def _ncclGetUniqueId(self, out):
        ctypes.memmove(ctypes.addressof(out._obj), self.uid, 128)
        return self.codes.get("ncclGetUniqueId", 0)

    def _ncclCommInitRank(self, out, world_size, uid, rank):
        out._obj.value = 0x1000
        return self.codes.get("ncclCommInitRank", 0)

    def names(self):
        return [name for name, _ in self.calls if name not in ("ncclGetErrorString", "ncclGetLastError")]
