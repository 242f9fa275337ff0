"""Per-request sampling seeds on the CPU SGLang server (patched in by sitecustomize.py).

SGLang 0.5.23 samples with a request's `sampling_params.sampling_seed` only under
`--enable-deterministic-inference` (sglang/srt/sampling/sampling_batch_info.py,
SamplingBatchInfo.from_schedule_batch, builds `sampling_seed` only then), and that flag refuses
the CPU server's torch_native attention (arg_groups/overrides.py, _deterministic_attention_backend)
and turns on Triton batch-invariant kernels. Its seeded draw, `multinomial_with_seed`
(layers/sampler.py), hashes through `sgl_kernel`'s murmur_hash32_cpu, which has no CPU wheel.
So on CPU, without the flag:
- `with_request_seeds` wraps from_schedule_batch: every batch carries its requests' seeds (a
  request sent without one is given a random seed, kept on the request, so it stays the same
  through its decode steps, and a batch of seeded and unseeded requests merges);
- `seeded_argmax` replaces multinomial_with_seed with the same contract in plain torch: row i's
  token from the Gumbel-max trick with noise drawn from (seed[i], position[i]) alone, so what a
  request samples never depends on the requests beside it in the batch.
The sampler then takes the seeded branch of sampling_from_probs_torch (and of the top-k/top-p
one) by itself; the log-probs it returns are unchanged (log of the same softmax).
"""

from __future__ import annotations

import random

MASK64 = (1 << 64) - 1


def stream_seed(seed: int, position: int) -> int:
    """A generator seed for one (request seed, position) pair: SplitMix64's finaliser over both,
    to the 32 bits torch's CPU generator reads (at::mt19937 is seeded from the low 32 bits)."""
    x = (seed * 0x9E3779B97F4A7C15 + position + 1) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return (x ^ (x >> 31)) & 0xFFFFFFFF


def seeded_argmax(logprobs, seed, positions):
    """multinomial_with_seed's contract (an (n, 1) index per row, drawn from softmax(logprobs[i])
    with seed[i] at positions[i]) without sgl_kernel: argmax(logprobs - log E), E ~ Exp(1) from a
    generator of that row's own. Float64 noise as upstream (its NOTE: float32 Gumbel noise is
    numerically unstable)."""
    import torch

    rows, width = logprobs.shape
    out = torch.empty(rows, 1, dtype=torch.long, device=logprobs.device)
    seeds, where = seed.tolist(), positions.tolist()
    for i in range(rows):
        generator = torch.Generator(device="cpu").manual_seed(stream_seed(int(seeds[i]), int(where[i])))
        noise = torch.empty(width, dtype=torch.float64).exponential_(generator=generator)
        out[i, 0] = torch.argmax(logprobs[i].to(torch.float64) - noise.log_())
    return out


def with_request_seeds(module) -> None:
    """Patches sglang.srt.sampling.sampling_batch_info (see the module docstring)."""
    import torch

    cls = module.SamplingBatchInfo
    build = cls.from_schedule_batch.__func__

    def from_schedule_batch(klass, batch, vocab_size: int):
        info = build(klass, batch, vocab_size)
        if info.sampling_seed is None:
            for req in batch.reqs:
                if req.sampling_params.sampling_seed is None:
                    req.sampling_params.sampling_seed = random.getrandbits(62)
            info.sampling_seed = torch.tensor([r.sampling_params.sampling_seed for r in batch.reqs],
                                              dtype=torch.int64, device=batch.device)
        return info

    cls.from_schedule_batch = classmethod(from_schedule_batch)


def cpu_seeded_sampler(module) -> None:
    """Patches sglang.srt.layers.sampler: its samplers look multinomial_with_seed up at call time."""
    module.multinomial_with_seed = seeded_argmax
