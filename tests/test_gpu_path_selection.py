"""The GPU path is chosen by config, and never loads the CPU bridge."""

import subprocess
import sys

import pytest

from helpers import REPO
from gspo_mcore.common.errors import InputError

# Slow (`slow` on each): those that run a CLI in a subprocess.


@pytest.mark.slow
def test_gpu_modules_do_not_import_the_cpu_bridge():
    code = (
        "import sys\n"
        "import gspo_mcore.megatron.parallel, gspo_mcore.megatron.optimizer, gspo_mcore.megatron.parity\n"
        "import gspo_mcore.megatron.qwen3_moe.model, gspo_mcore.megatron.qwen3_moe.parallel_weights\n"
        "sys.exit(int('gspo_mcore.megatron.cpu_bridge' in sys.modules))\n"
    )
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0


def test_te_spec_without_transformer_engine_is_a_clear_error():
    from gspo_mcore.megatron.qwen3_moe.layer_spec import decoder_block_spec

    with pytest.raises(InputError, match="'te' needs Transformer Engine"):
        decoder_block_spec(None, (), "te")


@pytest.mark.slow
def test_cuda_device_on_a_cpu_machine_is_a_clear_error(tiny_hf_dir):
    proc = subprocess.run(
        [sys.executable, "-m", "gspo_mcore.megatron.parity", f"model.hf_dir={tiny_hf_dir}", "distributed.device=cuda"],
        capture_output=True, text=True, cwd=REPO, timeout=300,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: distributed.device: 'cuda', but this machine has no usable CUDA device"
    )
