"""The SGLang server a run config describes: its command line and environment (servers a run
starts itself: gspo_mcore.engines.start_servers; the launch scripts': python -m gspo_mcore.engines.serve)."""

from __future__ import annotations

import sys

from gspo_mcore.common.errors import InputError
from gspo_mcore.megatron.qwen3_moe.hf_config import load_hf_config
from gspo_mcore.common.processes import child_env
from gspo_mcore.engines.sglang.sglang_cpu import server_env


def sglang_command(model_path: str, port: int, *, host: str = "127.0.0.1", device: str = "cpu",
                   dtype: str = "bfloat16", max_total_tokens: int = 8192, max_running_requests: int = 16,
                   tp: int = 1, extra_args: tuple[str, ...] = (), tokenizer: bool = False) -> list[str]:
    """`python -m sglang.launch_server ...` for a trainer-driven server: token ids in and out
    (no tokenizer unless `tokenizer`: SGLang matches stop strings on text), a bounded KV cache
    (unbounded, the CPU server took 14.5 GB)."""
    if load_hf_config(model_path).num_dense_layers:
        # Measured: with a dense layer its log-probs were off by 0.15-1.3 (all-MoE: within bf16 noise).
        raise InputError(
            f"{model_path}: SGLang 0.5.23 runs Qwen3-MoE dense layers (mlp_only_layers / decoder_sparse_step) "
            "as MoE, so its log-probs would not be this model's; serve an all-MoE model"
        )
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path, "--host", host,
           "--port", str(port), "--device", device, "--dtype", dtype,
           *([] if tokenizer else ["--skip-tokenizer-init"]), "--max-total-tokens", str(max_total_tokens),
           "--max-running-requests", str(max_running_requests), "--tp-size", str(tp)]
    if device == "cpu":
        # --sleep-on-idle: without it the idle scheduler busy-polls a core (measured 92% CPU),
        # which a CPU trainer on the same machine would lose.
        cmd += ["--attention-backend", "torch_native", "--sleep-on-idle"]
    return cmd + list(extra_args)


def server_for_config(config, port: int, host: str = "127.0.0.1", api_key: str | None = None) -> tuple[list[str], dict]:
    """The SGLang command and environment a run config describes (section `rollout`, the
    model, the device): one definition for servers a run starts and the launch scripts'.
    `api_key`: every request must then carry it (gspo_mcore.common.http)."""
    r = config.rollout
    device = config.distributed.device
    extra = ("--enable-return-routed-experts",) if r.return_routed_experts else ()
    if api_key:
        extra += ("--api-key", api_key)
    if r.stop and config.data.tokenizer_dir:  # the text stop strings are matched on is the policy's
        extra += ("--tokenizer-path", config.data.tokenizer_dir)
    cmd = sglang_command(config.model.hf_dir, port, host=host, device=device, dtype=r.engine_dtype,
                         max_total_tokens=r.max_total_tokens, max_running_requests=r.max_running_requests,
                         tp=r.engine_tp, extra_args=(*extra, *r.server_args), tokenizer=bool(r.stop))
    env = child_env()
    if device == "cpu":
        env = server_env(env)
    return cmd, env
