"""Typed run configuration, loaded from YAML. One section per concern, one source of truth."""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml

from gspo_mcore.errors import InputError


class ConfigError(InputError):
    """A config file or override that does not fit the dataclasses below."""


@dataclass
class ModelConfig:
    hf_dir: str = ""
    """Hugging Face checkpoint directory (config.json + safetensors) of a Qwen3-MoE model."""
    spec: Literal["local", "te"] = "local"
    """Module set: `te` = Transformer Engine with grouped GEMM (GPU); `local` = pure torch (CPU)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter and compute dtype."""
    moe_aux_loss_coeff: float = 0.0
    """Load-balancing aux loss. Off by default: in RL the router follows the policy gradient only."""


@dataclass
class DistributedConfig:
    device: Literal["cpu", "cuda"] = "cpu"
    """cpu: gloo + the megatron-core CPU bridge; cuda: NCCL. Chosen here, never guessed."""
    tensor_parallel: int = 1
    """TP size; sequence parallelism is always on when TP > 1 (Megatron requires it for MoE)."""
    pipeline_parallel: int = 1
    expert_parallel: int = 1
    expert_tensor_parallel: int = 1
    """TP size inside each expert (1 = experts unsplit, the usual choice for fine-grained MoE)."""


@dataclass
class OptimizerConfig:
    name: Literal["adam", "sgd"] = "adam"
    lr: float = 1e-6
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables."""
    distributed_optimizer: bool = True
    """Shard optimizer states over data-parallel ranks (Megatron's distributed optimizer)."""


@dataclass
class LossConfig:
    level: Literal["sequence", "sequence_token", "token"] = "sequence"
    """sequence = GSPO; sequence_token = GSPO-token; token = GRPO/PPO (for comparison runs)."""
    clip_low: float = 3e-4
    clip_high: float = 4e-4
    """The paper's GSPO clip range: ratios outside [1 - 3e-4, 1 + 4e-4] stop the gradient."""
    aggregation: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] | None = None
    """None: the paper's for the level (seq-mean-token-mean)."""
    dual_clip: float | None = None
    """Lower bound c * A for negative advantages (c > 1); None: off."""
    temperature: float = 1.0
    """The engine's sampling temperature; the trainer divides its logits by it too."""
    kl_loss_coef: float = 0.0
    """KL penalty to a reference policy; off in the paper's setup."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    log_entropy: bool = False
    """Compute the policy entropy (a metric; costs one more pass over the logits)."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    loss: LossConfig = field(default_factory=LossConfig)

    def validate(self) -> "Config":
        if self.model.spec == "te" and self.distributed.device != "cuda":
            raise ConfigError("model.spec: 'te' (Transformer Engine) needs distributed.device 'cuda'")
        for name in ("tensor_parallel", "pipeline_parallel", "expert_parallel", "expert_tensor_parallel"):
            if getattr(self.distributed, name) < 1:
                raise ConfigError(f"distributed.{name}: must be >= 1")
        return self


def _convert(tp, value, where: str):
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType) and type(None) in args:  # Optional[X]
        if value is None:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(inner, value, where)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return from_dict(tp, value, where)
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{where}: {value!r} is not one of {list(typing.get_args(tp))}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true/false, got {value!r}")
        return value
    if tp in (int, float, str):
        if isinstance(value, bool) or (tp is int and isinstance(value, float)):
            raise ConfigError(f"{where}: expected {tp.__name__}, got {value!r}")
        try:
            return tp(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected {tp.__name__}, got {value!r}") from None
    raise ConfigError(f"{where}: unsupported field type {tp}")


def from_dict(cls, data: dict, where: str = ""):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{where + '.' if where else ''}{unknown[0]}: unknown config field")
    kwargs = {
        key: _convert(hints[key], value, f"{where + '.' if where else ''}{key}") for key, value in data.items()
    }
    return cls(**kwargs)


def _set_override(data: dict, override: str) -> None:
    key, sep, raw = override.partition("=")
    if not sep:
        raise ConfigError(f"override {override!r}: expected key=value")
    *parents, leaf = key.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = yaml.safe_load(raw)


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{path}: config file not found")
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level")
    for override in overrides:
        _set_override(data, override)
    return from_dict(Config, data).validate()
