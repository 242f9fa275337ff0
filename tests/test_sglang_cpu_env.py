"""The CPU server's environment (gspo_mcore.engines.sglang.sglang_cpu.server_env): SGLang's model
registry skips every model module but Qwen3-MoE's (a start-up ~3 s of CPU shorter; every server
test starts servers with it), and a user's own choice is kept; its sitecustomize hides megatron,
compiles nothing and answers SIGTERM within a tenth of a second."""

import asyncio
import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gspo_mcore.engines.sglang.sglang_cpu import SHIM, server_env


def test_the_registry_skips_every_model_module_but_qwen3_moe():
    skipped = server_env({})["SGLANG_DISABLED_MODEL_ARCHS"].split(",")
    # Where SGLang is, without importing it (~2 s in each of the suite's workers).
    models = Path(importlib.util.find_spec("sglang").origin).parent / "srt" / "models"
    installed = {p.stem for p in models.glob("*.py")}
    assert "qwen3_moe" not in skipped and {"llama", "qwen2_moe", "qwen3"} <= set(skipped)
    assert set(skipped) == installed - {"qwen3_moe", "__init__", "registry"}


def test_a_users_own_list_is_kept():
    assert server_env({"SGLANG_DISABLED_MODEL_ARCHS": "llama"})["SGLANG_DISABLED_MODEL_ARCHS"] == "llama"


def test_the_servers_processes_do_not_import_megatron():
    """SGLang's tensor dumper tries megatron.core at import (its Megatron plugin); the CPU server's
    processes get an ImportError instead of ~1 s of imports (sitecustomize.py)."""
    code = "import megatron.core\n"
    hidden = subprocess.run([sys.executable, "-c", code], env=server_env(), capture_output=True, text=True)
    assert hidden.returncode == 1 and "megatron is not imported in a CPU SGLang server" in hidden.stderr
    env = {k: v for k, v in server_env().items() if k != "SGLANG_USE_CPU_ENGINE"}  # the trainer's own processes
    assert subprocess.run([sys.executable, "-c", "import megatron"], env=env).returncode == 0


@pytest.mark.slow  # imports SGLang (~5 s)
def test_the_servers_processes_compile_nothing_and_skip_transformers_llama():
    """A CPU server's processes compile nothing: torch.compile returns the function itself (SGLang's
    deep_gemm runner decorates one at import, and that call imported Inductor's compile_fx), and
    SGLang's re-export of LlamaFlashAttention2 (for DeepSeek-OCR's remote code) does not import
    transformers' Llama modeling. Together ~3.5 s of every server start's CPU."""
    code = ("import sys, torch\n"
            "f = lambda x: x\n"
            "assert torch.compile(f) is f and torch.compile(dynamic=True)(f) is f\n"
            "from sglang.srt.layers.moe.moe_runner import deep_gemm\n"
            "print(hasattr(deep_gemm._cast_to_e8m0_with_rounding_up, '_torchdynamo_orig_callable'),\n"
            "      'transformers.models.llama.modeling_llama' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], env=server_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "False False", done.stdout
    assert server_env({})["TORCH_COMPILE_DISABLE"] == "1"


def test_sigterm_is_seen_within_a_tenth_of_a_second():
    """The tokenizer manager's watchdog polled its SIGTERM flag every 5 s; the patch polls every
    0.1 s, then runs SGLang's own watchdog (its drain and stop), which finds the flag set."""
    spec = importlib.util.spec_from_file_location("shim_sitecustomize", SHIM / "sitecustomize.py")
    shim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shim)  # SGLANG_USE_CPU_ENGINE unset here: nothing is installed
    ran = []

    class TokenizerManager:
        gracefully_exit = False

        async def sigterm_watchdog(self):
            ran.append(self.gracefully_exit)

    module = type(sys)("tokenizer_manager")
    module.TokenizerManager = TokenizerManager
    shim._prompt_sigterm_watchdog(module)

    async def signal_then_wait(manager):
        watchdog = asyncio.ensure_future(manager.sigterm_watchdog())
        await asyncio.sleep(0.3)
        assert ran == []
        manager.gracefully_exit = True
        began = time.monotonic()
        await watchdog
        return time.monotonic() - began

    assert asyncio.run(signal_then_wait(TokenizerManager())) < 0.2 and ran == [True]
