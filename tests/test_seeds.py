"""Per-request sampling seeds (gspo_mcore.common.seeds): the rule itself, each trajectory turn's
own, the CPU SGLang server's seeded sampler (sglang_cpu/shim/gspo_sglang_seeds.py, patched into
the server by its sitecustomize) and the line a run starts with. What the clients send is in
tests/test_rollout_client.py and tests/test_vllm_response.py, the sources' seeds in
tests/test_rollout_source.py and tests/test_evaluation.py, two runs alike in tests/test_train.py
and tests/test_train_vllm.py."""

import asyncio
import importlib.util
import types

import pytest
import torch

from gspo_mcore.common.seeds import SEED_RANGE, eval_seed, request_seed, rollout_seed, step_seed, turn_seed
from helpers import REPO

SHIM = REPO / "gspo_mcore" / "engines" / "sglang" / "sglang_cpu" / "shim" / "gspo_sglang_seeds.py"


def test_a_seed_is_a_pure_function_of_the_run_seed_and_what_names_the_sample():
    # The rule is fixed: a changed hash would change every run's samples (and the docs' figures).
    assert rollout_seed(1234, 0, 0) == request_seed(1234, "rollout", 0, 0) == 3057609069
    seeds = [rollout_seed(1234, draw, k) for draw in range(500) for k in range(8)]
    assert len(set(seeds)) == len(seeds) and all(0 <= s < SEED_RANGE for s in seeds)
    assert rollout_seed(1234, 3, 1) == rollout_seed(1234, 3, 1) != rollout_seed(1235, 3, 1)
    # Neighbouring keys do not reach each other's seeds (the old rule's base + i did).
    assert rollout_seed(1234, 3, 1) not in {rollout_seed(1234, 3, 0) + 1, rollout_seed(1234, 4, 0)}
    evaluated = {eval_seed(1234, name, version, p, k) for name in ("toy", "math") for version in ("step-0", "step-10")
                 for p in range(4) for k in range(4)}
    assert len(evaluated) == 64 and not evaluated & set(seeds)
    assert step_seed(1234, 5) == 1234 * 1_000_003 + 5  # prompt and minibatch order: unchanged


def test_each_turn_of_a_trajectory_samples_with_its_own_seed():
    """vLLM seeds a request's generator with its seed: two turns seeded alike would draw alike."""
    from gspo_mcore.rollout.engine_handle import EngineHandle

    sent = []

    class Client:
        async def generate_one_async(self, name, ids, params, server, *versions, evaluation=False):
            sent.append(params.get("sampling_seed"))

    async def three_turns(handle):
        for _ in range(3):
            await handle.generate([1, 2])

    asyncio.run(three_turns(EngineHandle(Client(), None, 0, {"max_new_tokens": 2, "temperature": 1.0}, 99)))
    assert sent == [99, turn_seed(99, 1), turn_seed(99, 2)] and len(set(sent)) == 3
    asyncio.run(three_turns(EngineHandle(Client(), None, 0, {"max_new_tokens": 2, "temperature": 1.0}, None)))
    assert sent[3:] == [None] * 3  # unseeded: the server draws


def _shim():
    spec = importlib.util.spec_from_file_location("gspo_sglang_seeds", SHIM)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cpu_sglang_sampler_draws_a_rows_token_from_its_seed_and_position_alone():
    """multinomial_with_seed's contract without sgl_kernel: a row's token does not depend on the
    rows batched with it, changes with its seed or position, and follows softmax(logprobs)."""
    shim = _shim()
    logprobs = torch.log_softmax(torch.randn(6, 50, generator=torch.Generator().manual_seed(0)), dim=-1)
    seeds, positions = torch.arange(100, 106), torch.arange(6) + 20
    batch = shim.seeded_argmax(logprobs, seeds, positions)
    assert batch.shape == (6, 1) and batch.dtype == torch.long
    alone = [shim.seeded_argmax(logprobs[i:i + 1], seeds[i:i + 1], positions[i:i + 1]).item() for i in range(6)]
    assert batch.view(-1).tolist() == alone
    reversed_rows = shim.seeded_argmax(logprobs.flip(0), seeds.flip(0), positions.flip(0)).view(-1).flip(0)
    assert reversed_rows.tolist() == alone
    # Over many seeds (and positions), one row's draws follow its distribution.
    row = torch.log_softmax(torch.tensor([[2.0, 1.0, 0.0, -9.0]]), dim=-1)
    draws = [shim.seeded_argmax(row, torch.tensor([s]), torch.tensor([s % 7])).item() for s in range(4000)]
    frequencies = torch.bincount(torch.tensor(draws), minlength=4).double() / len(draws)
    assert torch.allclose(frequencies, row.exp().double().view(-1), atol=0.03), frequencies
    # The generator seed mixes both and keeps the 32 bits torch's CPU generator reads.
    assert len({shim.stream_seed(s, p) for s in range(50) for p in range(50)}) == 2500
    assert all(0 <= shim.stream_seed(2 ** 62, p) < 2 ** 32 for p in range(5))


def test_the_cpu_sglang_server_batches_carry_every_requests_seed():
    """SamplingBatchInfo.from_schedule_batch builds the seeds only under
    --enable-deterministic-inference: the patch gives every batch its requests' seeds, and a
    request sent without one a seed of its own that it keeps (a later batch of it reads the same)."""
    shim = _shim()

    class Info:
        @classmethod
        def from_schedule_batch(cls, batch, vocab_size):
            info = cls()
            info.sampling_seed = None  # as upstream without the flag
            return info

    module = types.SimpleNamespace(SamplingBatchInfo=Info)
    shim.with_request_seeds(module)
    requests = [types.SimpleNamespace(sampling_params=types.SimpleNamespace(sampling_seed=s)) for s in (7, None)]
    batch = types.SimpleNamespace(reqs=requests, device="cpu")
    first = Info.from_schedule_batch(batch, 100).sampling_seed
    again = Info.from_schedule_batch(batch, 100).sampling_seed
    assert first[0].item() == 7 and first.dtype == torch.int64 and torch.equal(first, again)
    sampler = types.SimpleNamespace(multinomial_with_seed=None)
    shim.cpu_seeded_sampler(sampler)
    assert sampler.multinomial_with_seed is shim.seeded_argmax


def test_the_cpu_sglang_servers_python_loads_the_patches():
    """sitecustomize.py names them for the two modules it patches, in the server's PYTHONPATH."""
    text = (SHIM.parent / "sitecustomize.py").read_text()
    assert '"sglang.srt.sampling.sampling_batch_info": _request_seeds' in text
    assert '"sglang.srt.layers.sampler": _seeded_sampler' in text


@pytest.mark.parametrize("overrides, says", [
    ([], "a rerun samples the same tokens (bar a float32 near-tie"),
    (["rollout.engine=vllm"], "a rerun samples the same tokens"),
    (["rollout.mode=async"], "a rerun may sample other tokens: rollout.mode async"),
    (["rollout.engine_dtype=bfloat16"], "a rerun samples the same tokens"),
    (["distributed.device=cuda"], "SGLang on GPU samples with the seeds, in batch-invariant kernels, only under "
                                  "--enable-deterministic-inference"),
    (["distributed.device=cuda", "rollout.server_args=[--enable-deterministic-inference]"],
     "a rerun samples the same tokens"),
    (["rollout.urls=[http://elsewhere:1]"], "rollout.urls: servers this run did not start"),
])
def test_the_run_says_at_start_whether_a_rerun_samples_the_same_tokens(overrides, says):
    from gspo_mcore.config import load_config
    from gspo_mcore.rollout.source import reproducibility

    line = reproducibility(load_config(REPO / "configs" / "tiny_cpu.yaml", overrides))
    assert line.startswith("sampling: each request seeded from train.seed") and says in line, line
    assert "\n" not in line
