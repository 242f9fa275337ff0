"""Start, health-check and stop an inference server process (SGLang), leaving no orphans."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from gspo_mcore.errors import InputError
from gspo_mcore.rollout.http import API_KEY_ENV, HTTPRequestError, get_json


def sglang_command(model_path: str, port: int, *, host: str = "127.0.0.1", device: str = "cpu",
                   dtype: str = "bfloat16", max_total_tokens: int = 8192, max_running_requests: int = 16,
                   tp: int = 1, extra_args: tuple[str, ...] = ()) -> list[str]:
    """`python -m sglang.launch_server ...` for a trainer-driven server: token ids in and out
    (no tokenizer), a bounded KV cache (unbounded, the CPU server took 14.5 GB)."""
    from gspo_mcore.models.qwen3_moe.hf_config import load_hf_config

    if load_hf_config(model_path).num_dense_layers:
        # Measured: with a dense layer its log-probs were off by 0.15-1.3 (all-MoE: within bf16 noise).
        raise InputError(
            f"{model_path}: SGLang 0.5.23 runs Qwen3-MoE dense layers (mlp_only_layers / decoder_sparse_step) "
            "as MoE, so its log-probs would not be this model's; serve an all-MoE model"
        )
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path, "--host", host,
           "--port", str(port), "--device", device, "--dtype", dtype, "--skip-tokenizer-init",
           "--max-total-tokens", str(max_total_tokens), "--max-running-requests", str(max_running_requests),
           "--tp-size", str(tp)]
    if device == "cpu":
        # --sleep-on-idle: without it the idle scheduler busy-polls a core (measured 92% CPU),
        # which a CPU trainer on the same machine would lose.
        cmd += ["--attention-backend", "torch_native", "--sleep-on-idle"]
    return cmd + list(extra_args)


# A launcher's identity (torchrun / torch.distributed.run): a server started from a trainer
# rank that inherits them joins the trainer's rendezvous and hangs at start-up (measured).
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def server_process_env(env: dict | None = None) -> dict:
    env = dict(os.environ if env is None else env)
    for key in list(env):
        if key in LAUNCHER_VARS or key.startswith("TORCHELASTIC_"):
            del env[key]
    return env


def server_for_config(config, port: int, host: str = "127.0.0.1") -> tuple[list[str], dict]:
    """The SGLang command and environment a run config describes (section `rollout`, the
    model, the device): one definition for servers a run starts and the launch scripts'."""
    r = config.rollout
    device = config.distributed.device
    extra = ("--enable-return-routed-experts",) if r.return_routed_experts else ()
    if os.environ.get(API_KEY_ENV):  # every request must carry it (gspo_mcore.rollout.http)
        extra += ("--api-key", os.environ[API_KEY_ENV])
    cmd = sglang_command(config.model.hf_dir, port, host=host, device=device, dtype=r.engine_dtype,
                         max_total_tokens=r.max_total_tokens, max_running_requests=r.max_running_requests,
                         tp=r.engine_tp, extra_args=(*extra, *r.server_args))
    env = server_process_env()
    if device == "cpu":
        from gspo_mcore.rollout.sglang_cpu import server_env

        env = server_env(env)
    return cmd, env


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """In a child between fork and exec (Linux): the kernel sends it `sig` when the process that
    started it dies, by any signal, SIGKILL included, so a killed trainer orphans no server
    (SGLang's launcher takes its own workers down on SIGTERM). Elsewhere: nothing."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return
    PR_SET_PDEATHSIG = 1
    libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


class ManagedServer:
    """A server subprocess in its own process group, its output streamed to `log_file`.
    `with ManagedServer(...) as server:` starts it, waits for /health, and always stops it."""

    def __init__(self, cmd: list[str], url: str, log_file: str | Path, env: dict | None = None,
                 startup_timeout_s: float = 300.0):
        self.cmd, self.url, self.log_file = cmd, url.rstrip("/"), Path(log_file)
        self.env, self.startup_timeout_s = env, startup_timeout_s
        self.process: subprocess.Popen | None = None

    def start(self) -> "ManagedServer":
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_file, "ab")
        self.process = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                        env=server_process_env(self.env), start_new_session=True,
                                        # The kernel ties it to the starting *thread*: only the
                                        # main thread's children, or a thread's end kills them.
                                        preexec_fn=die_with_parent if in_main_thread() else None)
        log.close()
        self.wait_healthy()
        return self

    def healthy(self) -> bool:
        try:
            get_json(f"{self.url}/health", timeout_s=5)  # SGLang answers 200 with an empty body
            return True
        except HTTPRequestError:
            return False

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise InputError(
                    f"server {self.url} exited with code {self.process.returncode} while starting; see {self.log_file}"
                )
            if self.healthy():
                return
            time.sleep(0.5)
        self.stop()
        raise InputError(f"server {self.url} not healthy after {self.startup_timeout_s:.0f} s; see {self.log_file}")

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM to the whole process group (the server's workers too), then SIGKILL."""
        if self.process is None or self.process.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.process.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        # Workers that outlived the leader share its process group.
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def __enter__(self) -> "ManagedServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def start_servers(config, log_dir: Path, stack: ExitStack) -> list[str]:
    """The CPU default / tests: `rollout.num_servers` SGLang servers for model.hf_dir that the
    run owns, on 127.0.0.1 behind an API key made for this run (in the environment, where the
    clients find it), stopped when `stack` closes. Returns their URLs."""
    import secrets

    from gspo_mcore.netaddr import free_port

    os.environ.setdefault(API_KEY_ENV, secrets.token_hex(16))
    urls = []
    for index in range(config.rollout.num_servers):
        port = free_port()
        cmd, env = server_for_config(config, port)
        url = f"http://127.0.0.1:{port}"
        stack.enter_context(ManagedServer(cmd, url, log_dir / f"sglang_{index}.log", env=env))
        urls.append(url)
    return urls


def main(argv=None) -> int:
    """`python -m gspo_mcore.rollout.server --config FILE --port P [--host H] [key=value ...]`:
    exec the SGLang server a config describes (the launch scripts' way to start one)."""
    import argparse

    from gspo_mcore.config import load_config

    parser = argparse.ArgumentParser(prog="python -m gspo_mcore.rollout.server")
    parser.add_argument("--config", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1",
                        help=f"0.0.0.0 to serve other hosts: then {API_KEY_ENV} must hold the run's API key")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args(argv)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not os.environ.get(API_KEY_ENV):
        raise InputError(f"--host {args.host}: a server other hosts can reach needs an API key in {API_KEY_ENV} "
                         "(anyone reaching it could load weights into it)")
    cmd, env = server_for_config(load_config(args.config, args.overrides), args.port, args.host)
    os.execvpe(cmd[0], cmd, env)
    return 0


if __name__ == "__main__":
    from gspo_mcore.errors import run_cli

    sys.exit(run_cli(main))

