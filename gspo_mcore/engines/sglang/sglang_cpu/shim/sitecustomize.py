"""Loaded by every Python process of a CPU SGLang server (the shim directory is on its
PYTHONPATH).

SGLang spawns its scheduler and detokenizer (`mp.set_start_method("spawn", force=True)` in
`sglang.srt.entrypoints.engine._set_envs_and_config`: CUDA needs it), and each spawned child
imported SGLang and torch again: 17 of a server start's 26 s of CPU (measured: launcher 8.8 s,
scheduler 9.6, detokenizer 7.3). Without CUDA nothing needs it: `Engine._launch_subprocesses`
forks them instead (then 10.6 s in all, ready in 12 s instead of 20 on an idle 2-core machine).
Only from a launcher with one thread (below; it starts its HTTP server and tokenizer manager
after them); the start method is spawn again once they run.

`--enable-return-routed-experts` allocates its host buffer through
`sglang.srt.mem_cache.pool_host.common.ALLOC_MEMORY_FUNCS[device]`, which has no "cpu" entry
in 0.5.23: it falls back to pinning with cudaHostRegister (`torch.cuda.cudart()`), and the
server dies at start-up without CUDA. On CPU the buffer is plain memory; the entry is added
when that module is first imported. Nothing else of the capturer needs CUDA on CPU (measured:
the routed experts of a tiny model matched a transformers forward, expert order included).

`sglang.srt.managers.load_snapshot.shm_path_for` puts each server start's load-snapshot file in
/dev/shm, and nothing of SGLang removes it (its writer's `close` only unmaps it): it goes into
the server's TMPDIR instead, which the process that started the server removes
(gspo_mcore.common.processes.ManagedServer).

SGLang's tensor dumper (`sglang.srt.debug_utils.dumper`, imported by every scheduler through its
model runner) tries `import megatron.core` at class definition for its Megatron plugin, a
debugging aid for training processes: where megatron-core is installed, as beside this trainer,
each server start imported it for nothing (0.7 s of CPU in a process that has the scheduler's
modules already, measured; a whole start is ~9-11 s). Hidden from the server's processes: the
plugin takes its not-available branch, nothing else of SGLang imports megatron.

Two imports at every start that a CPU server never uses (together, measured on the toy model: the
launcher's CPU 13.1 s -> 9.5 s, ready in 12.6 s instead of 16.6; 32 seeded requests' tokens and
log-probs bit for bit the same): `torch.compile` as a decorator at module level (the first, in
SGLang's deep_gemm runner, imported TorchDynamo and Inductor; a CPU server runs no compiled
function, and TORCH_COMPILE_DISABLE=1, which `server_env` sets, would make each run as written
anyway): where TorchDynamo is disabled it returns the function itself, without importing it. And
`hf_transformers_patches._patch_removed_symbols`, which imports transformers' Llama modeling (and
through it modeling_utils, quantizers, kernels) to re-export `LlamaFlashAttention2` for
DeepSeek-OCR's remote code: not a model these servers load.

On SIGTERM the tokenizer manager's `sigterm_watchdog` notices the signal's flag on its next 5 s
poll (`await asyncio.sleep(5)`), so every stop waited 0-5 s doing nothing (the tests stop some 30
servers): a poll of 0.1 s stands in before the watchdog itself runs, which then drains and stops
as before.
"""

import importlib.abc
import os
import sys
import tempfile


def _plain_host_buffer(dims, dtype, device, pin_memory, allocator=None, **_):
    import torch

    return torch.zeros(dims, dtype=dtype, device="cpu")


def _add_cpu_allocator(module) -> None:
    module.ALLOC_MEMORY_FUNCS.setdefault("cpu", _plain_host_buffer)


def _snapshot_in_tmpdir(module) -> None:
    in_shm = module.shm_path_for

    def shm_path_for(ipc_name: str) -> str:
        return os.path.join(tempfile.gettempdir(), os.path.basename(in_shm(ipc_name)))

    module.shm_path_for = shm_path_for  # looked up at call time by the module's own readers and writers


def _fork_children(module) -> None:
    import multiprocessing

    configure, launch = module._set_envs_and_config, module.Engine._launch_subprocesses.__func__

    def set_envs_and_config(server_args):
        configure(server_args)  # sets spawn
        # One thread: none can hold a lock the children need. Torch's OpenMP pool has threads of
        # its own unless OMP_NUM_THREADS=1 (the tests' setting), and libgomp does not support a
        # fork once its pool runs: then spawn, as SGLang does.
        if len(os.listdir("/proc/self/task")) == 1:
            multiprocessing.set_start_method("fork", force=True)

    def launch_subprocesses(cls, *args, **kwargs):
        try:
            return launch(cls, *args, **kwargs)
        finally:
            multiprocessing.set_start_method("spawn", force=True)

    module._set_envs_and_config = set_envs_and_config  # looked up at call time by _launch_subprocesses
    module.Engine._launch_subprocesses = classmethod(launch_subprocesses)


def _prompt_sigterm_watchdog(module) -> None:
    import asyncio

    manager = module.TokenizerManager
    watchdog = manager.sigterm_watchdog

    async def sigterm_watchdog(self):
        while not self.gracefully_exit:
            await asyncio.sleep(0.1)
        await watchdog(self)  # its own poll loop ends at once: the flag is set

    manager.sigterm_watchdog = sigterm_watchdog


def _request_seeds(module) -> None:
    from gspo_sglang_seeds import with_request_seeds

    with_request_seeds(module)


def _seeded_sampler(module) -> None:
    from gspo_sglang_seeds import cpu_seeded_sampler

    cpu_seeded_sampler(module)


def _compile_off_when_disabled(module) -> None:
    compile_ = module.compile

    def compile(model=None, *args, **kwargs):
        if os.environ.get("TORCH_COMPILE_DISABLE", "0") != "1":
            return compile_(model, *args, **kwargs)
        return (lambda fn: fn) if model is None else model

    module.compile = compile


def _no_llama_reexport(module) -> None:
    module._patch_removed_symbols = lambda: None  # looked up at call time by apply_all


# Per-request sampling seeds (gspo_sglang_seeds.py beside this file says why and how).
_PATCHES = {"torch": _compile_off_when_disabled,
            "sglang.srt.utils.hf_transformers_patches": _no_llama_reexport,
            "sglang.srt.mem_cache.pool_host.common": _add_cpu_allocator,
            "sglang.srt.managers.load_snapshot": _snapshot_in_tmpdir,
            "sglang.srt.entrypoints.engine": _fork_children,
            "sglang.srt.managers.tokenizer_manager": _prompt_sigterm_watchdog,
            "sglang.srt.sampling.sampling_batch_info": _request_seeds,
            "sglang.srt.layers.sampler": _seeded_sampler}


class _NoMegatron(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "megatron" or name.startswith("megatron."):
            raise ImportError(f"{name} is not imported in a CPU SGLang server (sitecustomize.py)", name=name)
        return None


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Wraps a patched module's loader so that its patch runs right after the module executes."""

    def find_spec(self, name, path, target=None):
        if name not in _PATCHES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            _PATCHES[name](module)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
    sys.meta_path.insert(0, _PatchOnImport())
    sys.meta_path.insert(0, _NoMegatron())
