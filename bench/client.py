"""Benchmark: the rollout client's cost against a stand-in SGLang engine (not a test).

    python bench/client.py [--in-flight 1024] [--response-tokens 8192] [--engine-tokens-per-s 50000]
                           [--seconds 10] [--ingest-seconds 5] [--smoke]

The engine is this file run with `--serve`, in its own process: an asyncio server on
127.0.0.1 (a minimal HTTP/1.1 parser: keep-alive, Content-Length bodies) that answers `POST
/generate` as SGLang 0.5.23 does with `return_logprob: true, logprob_start_len: -1` (output_ids,
meta_info.output_token_logprobs [[logprob, id, null], ...], finish_reason length, weight_version
and weight_versions spans step-0 / step-1), from a few canned responses of --response-tokens tokens
serialised once at start, and `POST /abort_request` (answers the requests it holds as aborted).
It answers at the rate it is told: 0 = at once; R > 0 = first come first served on a virtual
clock, each response released when R tokens/s of engine time reach it. A private `POST
/bench/control` sets the rate, returns counters, and can "cut" the engine: every request it
holds or receives from then on is answered at once with a 1-token response, so that a generate()
call ends soon after a measurement window (those short responses are not counted).

The client under test runs in this (the main) process, made by `make_client` only and used only
through `generate(prompts, sampling_params, weight_version=None, oldest_version=0)` (step-0 and
step-1 tokens both admissible), called over and over by a background thread (the trainer's
producer thread): --in-flight prompts of 100 to 2,000 random tokens per call, the client's
concurrency --in-flight.

Two measurements:
  ingest_tokens_per_s: the engine at rate 0; response tokens the client returned per second of
    wall time over whole generate() calls, until --ingest-seconds have passed (at least one call).
  trainer_slowdown: the main thread runs a stand-in for the training loop for --seconds and counts
    its iterations: one iteration is a pure-Python loop of 5,000 integer operations (holds the
    GIL, as Megatron's Python does) then a 256x256 float32 matmul with torch on one thread
    (releases it, as kernels and waits on the GPU do), about 0.2 ms each alone. Arms alone (the
    client idle) and with (the client ingesting from the engine at --engine-tokens-per-s, a rollout
    node's order of magnitude), run alternately (alone, with, alone, with: the 2-core machine is shared and noisy);
    slowdown = 1 - mean rate with / mean rate alone. A with-arm starts its window once the engine
    holds the call's requests (the burst of sending them is not in it), cuts the engine at its
    end and waits for generate() to return: achieved_tokens_per_s_under_load = full-length
    tokens returned / (call return - call start); under_load_return_lag_s = how long after the
    window's end the call returned (small: the client kept up).
No core pinning: the engine, the client's event-loop thread and the trainer share the machine's cores.
Last line, JSON: {"ingest_tokens_per_s", "trainer_slowdown", "achieved_tokens_per_s_under_load",
"under_load_return_lag_s", "engine_tokens_per_s", "client_cpu_s_per_mtoken" (the process's CPU
seconds per million tokens during the ingest arm), "ingest_gc_fraction" (of the ingest arm's wall
time, in Python's cyclic garbage collector: gc.callbacks), "engine_held_at_window_start" (requests
the engine held when a with-window began, the fewest: in flight for real), "in_flight",
"response_tokens", "seconds" (the whole run's wall time), ...}. --smoke: small sizes (64 in flight,
512-token responses, 1.5 s windows) through every path.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VARIANTS = 8  # canned responses, served in turn


# ---------------------------------------------------------------- the stand-in engine (--serve)

def _float32(x: float) -> float:
    """x through float32, as the engine's log-probs are (long reprs: -0.12345679104328156)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def canned_body(variant: int, tokens: int, vocab_size: int, seed: int) -> tuple[bytes, bytes]:
    """(before, after) the prompt_tokens number of one /generate answer of `tokens` tokens."""
    rng = random.Random(seed * 1000 + variant)
    ids = [rng.randrange(vocab_size) for _ in range(tokens)]
    logprobs = [_float32(-rng.expovariate(3.0) - 1e-6) for _ in range(tokens)]
    # Half the variants were continued across a weight update (step-0 then step-1), half not.
    switch = rng.randrange(1, tokens) if variant % 2 and tokens > 1 else tokens
    spans = [{"version": "step-0", "start": 0, "end": switch}]
    if switch < tokens:
        spans.append({"version": "step-1", "start": switch, "end": tokens})
    meta = {"id": f"{rng.getrandbits(128):032x}",
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, ids)],
            "finish_reason": {"type": "length", "length": tokens} if tokens > 1 else {"type": "stop", "matched": 0},
            "weight_version": spans[-1]["version"], "weight_versions": spans,
            "completion_tokens": tokens, "cached_tokens": 0, "e2e_latency": 1.0 + variant / 10, "prompt_tokens": 0}
    body = json.dumps({"output_ids": ids, "meta_info": meta}, separators=(",", ":")).encode()
    assert body.endswith(b'"prompt_tokens":0}}')
    return body[:-3], b"}}"


def abort_body() -> bytes:
    meta = {"id": "0" * 32, "output_token_logprobs": [], "finish_reason": {"type": "abort", "message": "Abort"},
            "weight_version": "step-0", "completion_tokens": 0, "prompt_tokens": 0}
    return json.dumps({"output_ids": [], "meta_info": meta}, separators=(",", ":")).encode()


class Engine:
    def __init__(self, tokens: int, vocab_size: int, rate: float, seed: int):
        self.tokens, self.rate = tokens, rate
        self.full = [canned_body(v, tokens, vocab_size, seed) for v in range(VARIANTS)]
        self.short = canned_body(0, 1, vocab_size, seed)
        self.aborted = abort_body()
        self.next_free = 0.0  # the virtual clock: when the engine has finished what it holds
        self.pending: set[asyncio.Future] = set()
        self.cut = False
        self.counts = dict(requests=0, full_responses=0, full_tokens=0, short_responses=0, aborted=0, connections=0)
        self.turn = 0

    def _release(self, future: asyncio.Future, how: str) -> None:
        if not future.done():
            future.set_result(how)

    def _release_all(self, how: str) -> None:
        for future in list(self.pending):
            self._release(future, how)
        self.next_free = asyncio.get_running_loop().time()

    async def generate(self, body: bytes) -> tuple[bytes, ...]:
        self.counts["requests"] += 1
        prompt_tokens = len(json.loads(body).get("input_ids") or [])
        how = "short" if self.cut else "full"
        if how == "full" and self.rate > 0:
            loop = asyncio.get_running_loop()
            self.next_free = max(self.next_free, loop.time()) + self.tokens / self.rate
            future = loop.create_future()
            self.pending.add(future)
            timer = loop.call_at(self.next_free, self._release, future, "full")
            try:
                how = await future
            finally:
                timer.cancel()
                self.pending.discard(future)
        if how == "abort":
            self.counts["aborted"] += 1
            return (self.aborted,)
        if how == "short":
            self.counts["short_responses"] += 1
            before, after = self.short
        else:
            self.counts["full_responses"] += 1
            self.counts["full_tokens"] += self.tokens
            before, after = self.full[self.turn % VARIANTS]
            self.turn += 1
        return before, str(prompt_tokens).encode(), after

    def control(self, body: bytes) -> bytes:
        order = json.loads(body or b"{}")
        if "rate" in order:
            self.rate = float(order["rate"])
            self._release_all("full")  # those held under the old rate go now
        if "cut" in order:
            self.cut = bool(order["cut"])
            if self.cut:
                self._release_all("short")
        return json.dumps({**self.counts, "held": len(self.pending), "rate": self.rate, "cut": self.cut}).encode()

    async def route(self, method: str, path: str, body: bytes) -> tuple[str, tuple[bytes, ...]]:
        if method == "POST" and path == "/generate":
            return "200 OK", await self.generate(body)
        if method == "POST" and path == "/abort_request":
            self._release_all("abort")
            return "200 OK", (b"{}",)
        if method == "POST" and path == "/bench/control":
            return "200 OK", (self.control(body),)
        return "404 Not Found", (b'{"message":"not found"}',)

    async def connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.counts["connections"] += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, path, version = (lines[0].split(" ", 2) + ["", ""])[:3]
                headers = {}
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    headers[name.strip().lower()] = value.strip()
                try:
                    body = await reader.readexactly(int(headers.get("content-length") or 0))
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                close = headers.get("connection", "").lower() == "close" or version == "HTTP/1.0"
                status, parts = await self.route(method, path.split("?", 1)[0], body)
                size = sum(len(p) for p in parts)
                writer.write(f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {size}\r\n"
                             f"connection: {'close' if close else 'keep-alive'}\r\n\r\n".encode())
                for part in parts:
                    writer.write(part)
                await writer.drain()
                if close:
                    return
        except ConnectionError:
            pass
        finally:
            writer.close()


async def serve(args: argparse.Namespace) -> None:
    engine = Engine(args.response_tokens, args.vocab_size, args.engine_tokens_per_s, args.seed)
    server = await asyncio.start_server(engine.connection, "127.0.0.1", 0, backlog=4096, limit=2**20)
    print(server.sockets[0].getsockname()[1], flush=True)
    # The parent holds our stdin open: end-of-file means it is gone (however it died).
    loop, gone = asyncio.get_running_loop(), asyncio.Event()

    def parent_check() -> None:
        if not os.read(sys.stdin.fileno(), 4096):
            gone.set()
    loop.add_reader(sys.stdin.fileno(), parent_check)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, gone.set)
    async with server:
        await gone.wait()


class EngineProcess:
    """The stand-in engine in its own process; killed on exit, however the bench ends."""

    def __init__(self, args: argparse.Namespace):
        command = [sys.executable, __file__, "--serve", "--response-tokens", str(args.response_tokens),
                   "--vocab-size", str(args.vocab_size), "--engine-tokens-per-s", "0", "--seed", str(args.seed)]
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     start_new_session=True)  # our Ctrl-C is for us; we end it ourselves
        line = self.proc.stdout.readline()
        if not line.strip():
            self.close()
            raise RuntimeError(f"the stand-in engine did not start (exit {self.proc.poll()})")
        self.port = int(line)
        self.url = f"http://127.0.0.1:{self.port}"

    def control(self, **order) -> dict:
        import urllib.request
        request = urllib.request.Request(f"{self.url}/bench/control", data=json.dumps(order).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as answer:
            return json.loads(answer.read())

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            stream.close()


# ---------------------------------------------------------------- the client side

def make_client(urls: list[str], vocab_size: int, max_in_flight: int):
    """The one place the client under test is made."""
    from gspo_mcore.engines.sglang.client import SGLangClient
    return SGLangClient(urls, vocab_size, max_concurrency=max_in_flight)


class Producer:
    """generate() calls, one after another, on a background thread (the trainer's producer),
    until told to stop; a call under way when stopped finishes (the engine is cut to end it)."""

    def __init__(self, client, prompts: list[list[int]], params: dict, full_tokens: int):
        self.client, self.prompts, self.params, self.full_tokens = client, prompts, params, full_tokens
        self.stop = threading.Event()
        self.tokens = self.full = self.short = self.calls = 0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="producer", daemon=True)

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                rollouts = self.client.generate(self.prompts, self.params, weight_version=None, oldest_version=0)
                for rollout in rollouts:
                    if len(rollout.response_ids) == self.full_tokens:
                        self.full += 1
                        self.tokens += self.full_tokens
                    else:
                        self.short += 1
                self.calls += 1
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            self.error = err

    def start(self) -> Producer:
        self.started = time.perf_counter()
        self.thread.start()
        return self

    def finish(self, timeout_s: float) -> float:
        """Stop after the call under way; its wall time from start."""
        self.stop.set()
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            raise RuntimeError(f"generate() did not return within {timeout_s:.0f} s")
        if self.error is not None:
            raise RuntimeError(f"generate() failed: {self.error!r}") from self.error
        return time.perf_counter() - self.started


class Trainer:
    """The stand-in training loop (see the module docstring)."""

    def __init__(self):
        import torch
        torch.set_num_threads(1)
        self.torch = torch
        generator = torch.Generator().manual_seed(0)
        self.a = torch.randn(256, 256, generator=generator)
        self.b = torch.randn(256, 256, generator=generator)

    def step(self) -> int:
        total = 0
        for i in range(5000):  # holds the GIL
            total += (i * i) % 7
        self.torch.mm(self.a, self.b)  # releases it
        return total

    def run(self, seconds: float) -> float:
        """Iterations per second over `seconds` of wall time."""
        count, start = 0, time.perf_counter()
        end = start + seconds
        while time.perf_counter() < end:
            self.step()
            count += 1
        return count / (time.perf_counter() - start)


class GCClock:
    """Seconds spent in the cyclic garbage collector (any thread) while installed."""

    def __init__(self):
        self.seconds, self.collections, self._since = 0.0, 0, 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._since = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._since
            self.collections += 1

    def __enter__(self) -> GCClock:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)


def wait_for_requests(engine: EngineProcess, at_least: int, timeout_s: float) -> None:
    """Until the engine has received `at_least` more requests (the call's burst is sent)."""
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline and engine.control()["requests"] < at_least:
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--in-flight", type=int, default=1024)
    parser.add_argument("--response-tokens", type=int, default=8192)
    parser.add_argument("--engine-tokens-per-s", type=float, default=50000.0,
                        help="the engine's rate in the slowdown arm (with --serve: its initial rate; 0 = at once)")
    parser.add_argument("--seconds", type=float, default=10.0, help="each trainer window (4 of them)")
    parser.add_argument("--ingest-seconds", type=float, default=5.0,
                        help="the ingest arm: generate() calls until this much time has passed (at least one)")
    parser.add_argument("--vocab-size", type=int, default=151936)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="small sizes, every code path (tens of seconds)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args))
        return
    if args.smoke:
        args.in_flight, args.response_tokens, args.seconds, args.ingest_seconds = 64, 512, 1.5, 1.5
    begin = time.perf_counter()
    sys.path.insert(0, str(REPO))
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(args.vocab_size) for _ in range(rng.randint(100, 2000))] for _ in range(args.in_flight)]
    params = {"temperature": 1.0, "max_new_tokens": args.response_tokens}
    trainer = Trainer()
    engine = EngineProcess(args)
    client = None
    try:
        client = make_client([engine.url], args.vocab_size, args.in_flight)
        print(f"engine: {engine.url} (pid {engine.proc.pid}); {args.in_flight} requests in flight, "
              f"{args.response_tokens}-token responses, prompts of 100-2000 tokens")

        # Ingest: the engine at once, whole generate() calls until --ingest-seconds.
        engine.control(rate=0, cut=False)
        cpu0, engine_cpu0 = time.process_time(), engine.cpu_s()
        with GCClock() as gc_clock:
            producer = Producer(client, prompts, params, args.response_tokens).start()
            while time.perf_counter() - producer.started < args.ingest_seconds and producer.thread.is_alive():
                time.sleep(0.05)
            ingest_wall = producer.finish(timeout_s=900)
        client_cpu, engine_cpu = time.process_time() - cpu0, engine.cpu_s() - engine_cpu0
        ingest_tokens = producer.tokens
        ingest = ingest_tokens / ingest_wall
        print(f"ingest (engine at once): {producer.tokens:,} tokens in {producer.calls} call(s), {ingest_wall:.1f} s: "
              f"{ingest:,.0f} tokens/s; client process CPU {client_cpu:.1f} s "
              f"({client_cpu / ingest_wall:.2f} cores, {client_cpu / producer.tokens * 1e6:.2f} s per M tokens), "
              f"engine CPU {engine_cpu:.1f} s; {gc_clock.seconds:.1f} s in {gc_clock.collections} garbage collections "
              f"({gc_clock.seconds / ingest_wall:.0%} of the wall time)")

        # Trainer alone / with the client ingesting at the engine's rate, alternately.
        trainer.run(min(1.0, args.seconds / 4))  # warm-up
        alone, along, achieved, lags, held = [], [], [], [], []
        for arm in ("alone", "with", "alone", "with"):
            if arm == "alone":
                rate = trainer.run(args.seconds)
                alone.append(rate)
                print(f"trainer alone: {rate:,.0f} it/s")
                continue
            engine.control(rate=args.engine_tokens_per_s, cut=False)
            before = engine.control()["requests"]
            producer = Producer(client, prompts, params, args.response_tokens).start()
            wait_for_requests(engine, before + args.in_flight, timeout_s=10)
            held.append(engine.control()["held"])
            rate = trainer.run(args.seconds)
            window_end = time.perf_counter()
            engine.control(cut=True)
            wall = producer.finish(timeout_s=300)
            lag = time.perf_counter() - window_end
            engine.control(cut=False)
            along.append(rate)
            achieved.append(producer.tokens / wall)
            lags.append(lag)
            print(f"trainer with the client at {args.engine_tokens_per_s:,.0f} tokens/s ({held[-1]} requests held by "
                  f"the engine at the start): {rate:,.0f} it/s; "
                  f"client returned {producer.tokens:,} full-length tokens ({producer.full} responses, "
                  f"{producer.short} cut short) in {wall:.1f} s: {achieved[-1]:,.0f} tokens/s, "
                  f"returned {lag:.2f} s after the window")
        slowdown = 1 - (sum(along) / len(along)) / (sum(alone) / len(alone))
        print(f"trainer slowdown: {slowdown:.1%} (it/s alone {[round(r) for r in alone]}, "
              f"with {[round(r) for r in along]})")
        result = {
            "ingest_tokens_per_s": round(ingest), "trainer_slowdown": round(slowdown, 4),
            "achieved_tokens_per_s_under_load": round(sum(achieved) / len(achieved)),
            "under_load_return_lag_s": round(max(lags), 2), "engine_tokens_per_s": args.engine_tokens_per_s,
            "client_cpu_s_per_mtoken": round(client_cpu / max(1, ingest_tokens) * 1e6, 3),
            "ingest_gc_fraction": round(gc_clock.seconds / ingest_wall, 3),
            "engine_held_at_window_start": min(held),
            "trainer_it_per_s_alone": [round(r) for r in alone], "trainer_it_per_s_with": [round(r) for r in along],
            "in_flight": args.in_flight, "response_tokens": args.response_tokens, "window_s": args.seconds,
            "smoke": args.smoke, "seconds": round(time.perf_counter() - begin, 1)}
    finally:
        try:
            if client is not None:
                client.close()
        finally:
            engine.close()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
