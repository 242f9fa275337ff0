"""The Megatron-Core side: process groups and parallel state, the learner (policy, reference,
DDP, optimizer), the loss inside Megatron's pipeline schedule, checkpoints, the CPU bridge that
runs megatron-core with gloo, routed-expert delivery, HF parity, and the model (`qwen3_moe`:
layer spec, forward, HF <-> Megatron weights, which the checkpoint converter shares)."""

import functools as _functools
import os as _os
import importlib.machinery as _machinery
import sys as _sys


class _MegatronImport:
    """What megatron.core's own __init__ does at import that this project never uses, skipped while
    it runs (a finder for that one module; nothing is imported here, so modules of this package
    that need no Megatron, the HF <-> Megatron table, stay light):

    - wandb: its inference contexts import it when installed
      (megatron/core/inference/contexts/dynamic_context.py, its inference engine's logging: ~0.5 s
      a process, and this project never runs that engine). Hidden (an import of it raises
      ImportError: megatron takes its no-wandb branch); the W&B sink (train.wandb_project) imports
      it afterwards as usual.
    - torch.compile at decoration time: megatron.core.jit binds `jit_fuser = torch.compile` and
      decorates its fused functions with it at import, and each such call imports TorchDynamo and
      Inductor (~2 s of CPU a process, measured: 5.1-5.4 s -> 3.1-3.6 s for megatron.core.tensor_parallel;
      every trainer rank pays it, the suite ~200 times). `_compile_at_first_call` stands in while
      __init__ runs: the function is compiled by the real torch.compile, with its options, the
      first time it is called (torch.compile's own result compiles at first call too), so a GPU run
      that uses the fusions compiles them as before. Where TorchDynamo is disabled
      (TORCH_COMPILE_DISABLE=1, which the CPU path sets: gspo_mcore.megatron.cpu_bridge) torch.compile's
      result runs the function as written, and so does this, without torch.compile: calling it
      imported TorchDynamo and Inductor (~2 s of CPU) at the first MoE routing of every CPU rank
      (megatron/core/transformer/moe/router.py, `_apply_expert_bias`, runs on every forward)."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name != "megatron.core":
            return None
        spec = _machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _MegatronLoader(spec.loader)
        return spec


def _compile_at_first_call(compile_now):
    def compile(model=None, **options):
        if model is None:  # @torch.compile(**options)
            return lambda fn: compile(fn, **options)
        if not callable(model) or isinstance(model, type) or hasattr(model, "parameters"):
            return compile_now(model, **options)  # modules and classes: as asked, at once
        compiled = None

        @_functools.wraps(model)
        def call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = model if _compiler_disabled() else compile_now(model, **options)
            return compiled(*args, **kwargs)

        return call

    return compile


def _compiler_disabled() -> bool:
    """TorchDynamo's `config.disable` (read from TORCH_COMPILE_DISABLE when it is imported), without
    importing it."""
    dynamo = _sys.modules.get("torch._dynamo")
    if dynamo is not None:
        return bool(dynamo.config.disable)
    return _os.environ.get("TORCH_COMPILE_DISABLE", "0") == "1"


class _MegatronLoader:
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        import torch

        hidden = "wandb" not in _sys.modules
        if hidden:
            _sys.modules["wandb"] = None
        compile_now, torch.compile = torch.compile, _compile_at_first_call(torch.compile)
        try:
            self.loader.exec_module(module)
        finally:
            torch.compile = compile_now
            if hidden and _sys.modules.get("wandb", 0) is None:
                del _sys.modules["wandb"]

    def __getattr__(self, name):  # get_code, get_resource_reader, ...: the real loader's
        return getattr(self.loader, name)


if "megatron.core" not in _sys.modules and not any(isinstance(f, _MegatronImport) for f in _sys.meta_path):
    _sys.meta_path.insert(0, _MegatronImport())
