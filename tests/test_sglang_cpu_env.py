"""The CPU server's environment (gspo_mcore.engines.sglang.sglang_cpu.server_env): SGLang's model
registry skips every model module but Qwen3-MoE's (a start-up ~3 s of CPU shorter; every server
test starts servers with it), and a user's own choice is kept."""

from pathlib import Path

import sglang

from gspo_mcore.engines.sglang.sglang_cpu import server_env


def test_the_registry_skips_every_model_module_but_qwen3_moe():
    skipped = server_env({})["SGLANG_DISABLED_MODEL_ARCHS"].split(",")
    installed = {p.stem for p in (Path(sglang.__file__).parent / "srt" / "models").glob("*.py")}
    assert "qwen3_moe" not in skipped and {"llama", "qwen2_moe", "qwen3"} <= set(skipped)
    assert set(skipped) == installed - {"qwen3_moe", "__init__", "registry"}


def test_a_users_own_list_is_kept():
    assert server_env({"SGLANG_DISABLED_MODEL_ARCHS": "llama"})["SGLANG_DISABLED_MODEL_ARCHS"] == "llama"
