"""Typed run configuration, loaded from YAML. One section per concern, one source of truth:
`schema` (the sections, their fields, docs, defaults, own checks and resume policy), `validate`
(checks across sections), `load` (YAML + overrides)."""

from gspo_mcore.config.load import LEVEL_FUNCTIONS, MOVED, REPLACED, config_yaml, from_dict, load_config
from gspo_mcore.config.schema import (RESUME, Config, DataConfig, DistributedConfig, EvalConfig, EvalDatasetConfig,
                                      LossConfig, ModelConfig, OptimizerConfig, RewardConfig, RolloutConfig,
                                      TrainConfig, WeightSyncConfig, resume_fields)
from gspo_mcore.config.validate import ConfigError

__all__ = ["LEVEL_FUNCTIONS", "MOVED", "REPLACED", "RESUME", "Config", "ConfigError", "DataConfig", "DistributedConfig",
           "EvalConfig", "EvalDatasetConfig", "LossConfig", "ModelConfig", "OptimizerConfig", "RewardConfig",
           "RolloutConfig", "TrainConfig", "WeightSyncConfig", "config_yaml", "from_dict", "load_config",
           "resume_fields"]
