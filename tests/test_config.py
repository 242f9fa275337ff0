import pytest

from gspo_mcore.config import Config, ConfigError, load_config


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  hf_dir: /ckpt\n  dtype: bfloat16\ndistributed:\n  expert_parallel: 2\n")
    cfg = load_config(path, ["distributed.tensor_parallel=2", "optimizer.lr=3e-6"])
    assert isinstance(cfg, Config)
    assert (cfg.model.hf_dir, cfg.model.dtype, cfg.model.spec) == ("/ckpt", "bfloat16", "local")
    assert (cfg.distributed.expert_parallel, cfg.distributed.tensor_parallel) == (2, 2)
    assert cfg.optimizer.lr == 3e-6
    assert (cfg.loss.level, cfg.loss.clip_low, cfg.loss.clip_high, cfg.loss.aggregation) == ("sequence", 3e-4, 4e-4, None)
    cfg = load_config(None, ["loss.dual_clip=3", "loss.aggregation=token-mean", "loss.dual_clip=null"])
    assert cfg.loss.dual_clip is None and cfg.loss.aggregation == "token-mean"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.spec=tensorrt"], "model.spec: 'tensorrt' is not one of"),
        (["model.spec=te"], "needs distributed.device 'cuda'"),
        (["distributed.expert_parallel=two"], "distributed.expert_parallel: expected int"),
        (["distributed.expert_parallel=1.5"], "distributed.expert_parallel: expected int"),
        (["distributed.pipeline_parallel=0"], "distributed.pipeline_parallel: must be >= 1"),
        (["model.hf_dri=/x"], "model.hf_dri: unknown config field"),
        (["optimizer.distributed_optimizer=3"], "expected true/false"),
        (["model"], "expected key=value"),
        (["loss.level=grpo"], "loss.level: 'grpo' is not one of"),
        (["loss.aggregation=mean"], "loss.aggregation: 'mean' is not one of"),
        (["loss.dual_clip=big"], "loss.dual_clip: expected float"),
    ],
)
def test_bad_values_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml: config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_shipped_configs_load():
    from conftest import REPO

    for path in sorted((REPO / "configs").glob("*.yaml")):
        load_config(path)
