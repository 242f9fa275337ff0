"""From a config to this rank's model: the start-up sequence every entry point shares."""

from __future__ import annotations

from gspo_mcore.megatron.checkpointing import load_model_weights
from gspo_mcore.config import Config
from gspo_mcore.megatron.qwen3_moe.hf_config import Qwen3MoeArch, load_hf_config
from gspo_mcore.megatron.qwen3_moe.model import build_model, check_layout
from gspo_mcore.megatron.qwen3_moe.parallel_weights import load_hf_weights
from gspo_mcore.megatron.parallel import init_distributed, world_size
from gspo_mcore.common.safetensors_io import HFCheckpointReader


def join_process_groups(config: Config) -> Qwen3MoeArch:
    """The model's architecture, with the layout checked against it before any process group
    work, then the process groups joined (gspo_mcore.megatron.parallel.init_distributed)."""
    arch = load_hf_config(config.model.hf_dir)
    check_layout(arch, config.distributed, world_size())
    init_distributed(config.distributed, seed=config.train.seed)
    return arch


def model_from_config(config: Config, load_weights: bool = True,
                      arch: Qwen3MoeArch | None = None) -> tuple[Qwen3MoeArch, object]:
    """This rank's GPTModel, by default filled from the HF checkpoint (or model.mcore_dir).
    `arch`: the caller joined the process groups already (join_process_groups); without it,
    this joins them first."""
    if arch is None:
        arch = join_process_groups(config)
    model = build_model(arch, config.model, config.distributed, routing_replay=config.train.routing_replay)
    if load_weights:
        load_initial_weights(model, arch, config)
    return arch, model


def load_initial_weights(model, arch: Qwen3MoeArch, config: Config) -> None:
    """The run's starting weights: model.mcore_dir's torch_dist checkpoint, else model.hf_dir's safetensors."""
    if config.model.mcore_dir:

        load_model_weights(model, config.model.mcore_dir)
    else:
        load_hf_weights(model, arch, config.model.spec, HFCheckpointReader(config.model.hf_dir).__getitem__)


def reference_model(config: Config, arch: Qwen3MoeArch):
    """A frozen copy of the initial weights in this rank's layout (the KL term's pi_ref);
    the process groups must exist (join_process_groups first)."""
    model = build_model(arch, config.model, config.distributed)
    load_initial_weights(model, arch, config)
    model.eval()
    model.requires_grad_(False)
    return model
