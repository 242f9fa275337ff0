"""The Megatron-Core side: process groups and parallel state, the learner (policy, reference,
DDP, optimizer), the loss inside Megatron's pipeline schedule, checkpoints, the CPU bridge that
runs megatron-core with gloo, routed-expert delivery, HF parity, and the model (`qwen3_moe`:
layer spec, forward, HF <-> Megatron weights, which the checkpoint converter shares)."""

import sys as _sys

# megatron.core's __init__ imports its inference contexts, which import wandb when it is installed
# (megatron/core/inference/contexts/dynamic_context.py, for its inference engine's logging: ~0.5 s a
# process, and this project never runs that engine). Hidden for that one import only: the W&B sink
# (train.wandb_project) imports wandb itself, afterwards, as usual.
if "megatron.core" not in _sys.modules and "wandb" not in _sys.modules:
    _sys.modules["wandb"] = None  # an import of it raises ImportError: megatron takes its no-wandb branch
    try:
        import megatron.core  # noqa: F401
    finally:
        del _sys.modules["wandb"]
