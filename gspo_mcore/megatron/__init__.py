"""The Megatron-Core side: process groups and parallel state, the learner (policy, reference,
DDP, optimizer), the loss inside Megatron's pipeline schedule, checkpoints, the CPU bridge that
runs megatron-core with gloo, routed-expert delivery, HF parity, and the model (`qwen3_moe`:
layer spec, forward, HF <-> Megatron weights, which the checkpoint converter shares)."""

import importlib.machinery as _machinery
import sys as _sys


class _WithoutWandb:
    """megatron.core's __init__ imports its inference contexts, which import wandb when it is installed
    (megatron/core/inference/contexts/dynamic_context.py, for its inference engine's logging: ~0.5 s a
    process, and this project never runs that engine). While megatron.core's own __init__ runs,
    wandb is hidden (an import of it raises ImportError: megatron takes its no-wandb branch); the
    W&B sink (train.wandb_project) imports it afterwards as usual. Nothing is imported here, so
    modules of this package that need no Megatron (the HF <-> Megatron table) stay light."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name != "megatron.core" or "wandb" in _sys.modules:
            return None
        spec = _machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _HidingLoader(spec.loader)
        return spec


class _HidingLoader:
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        hidden = "wandb" not in _sys.modules
        if hidden:
            _sys.modules["wandb"] = None
        try:
            self.loader.exec_module(module)
        finally:
            if hidden and _sys.modules.get("wandb", 0) is None:
                del _sys.modules["wandb"]

    def __getattr__(self, name):  # get_code, get_resource_reader, ...: the real loader's
        return getattr(self.loader, name)


if "megatron.core" not in _sys.modules and not any(isinstance(f, _WithoutWandb) for f in _sys.meta_path):
    _sys.meta_path.insert(0, _WithoutWandb())
