import os
from pathlib import Path

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
    assert (cfg.loss.function, cfg.loss.clip_low, cfg.loss.clip_high, cfg.loss.aggregation) == ("gspo", 3e-4, 4e-4, None)
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
        (["rollout.temperature=0"], "rollout.temperature: must be > 0"),
        (["optimizer.distributed_optimizer=3"], "expected true/false"),
        (["model"], "expected key=value"),
        (["loss.aggregation=mean"], "loss.aggregation: 'mean' is not one of"),
        (["loss.dual_clip=big"], "loss.dual_clip: expected float"),
        (["rollout.urls=http://a"], "rollout.urls: expected a list"),
        (["data.chat_template_kwargs=[1]"], "data.chat_template_kwargs: expected a mapping with string keys"),
        (["rollout.stop=</answer>"], "rollout.stop: expected a list"),
        (["train.num_minibatches=0"], "train.num_minibatches: must be >= 1"),
        (["rollout.oversample=0.5"], "rollout.oversample: must be >= 1"),
        (["weight_sync.method=nfs"], "weight_sync.method: 'nfs' is not one of"),
        (["weight_sync.colocate=true", "distributed.device=cuda"], "'distributed' cannot reach colocated servers"),
        (["weight_sync.method=tensor"], "'tensor' needs weight_sync.colocate"),
        (["weight_sync.method=tensor", "weight_sync.colocate=true", "distributed.expert_tensor_parallel=2"],
         "'tensor' needs distributed.expert_tensor_parallel 1"),
    ],
)
def test_bad_values_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_chat_template_kwargs_and_stop_strings(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("data:\n  chat_template_kwargs: {enable_thinking: false}\nrollout:\n  stop: ['</answer>']\n")
    cfg = load_config(path, ["data.chat_template_kwargs.tools=[]"])
    assert cfg.data.chat_template_kwargs == {"enable_thinking": False, "tools": []}
    assert cfg.rollout.stop == ["</answer>"] and load_config(None).rollout.stop == []


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml: config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_shipped_configs_load():
    from helpers import REPO

    for path in sorted((REPO / "configs").glob("*.yaml")):
        load_config(path)


def test_base_config_is_merged_key_by_key(tmp_path):
    (tmp_path / "base.yaml").write_text("loss:\n  function: gspo\n  clip_low: 0.001\ntrain:\n  steps: 7\n")
    (tmp_path / "child.yaml").write_text("base: base.yaml\nloss:\n  function: grpo\n")
    cfg = load_config(tmp_path / "child.yaml", ["train.group_size=4"])
    assert (cfg.loss.function, cfg.loss.clip_low, cfg.train.steps, cfg.train.group_size) == ("grpo", 0.001, 7, 4)


def test_base_config_errors_name_the_file(tmp_path):
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(ConfigError, match="a.yaml: `base` chain loops back to itself"):
        load_config(tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("base: missing.yaml\n")
    with pytest.raises(ConfigError, match="missing.yaml: config file not found"):
        load_config(tmp_path / "c.yaml")
    (tmp_path / "d.yaml").write_text("loss: [unclosed\n")
    with pytest.raises(ConfigError, match="d.yaml: not valid YAML"):
        load_config(tmp_path / "d.yaml")


def test_grpo_comparison_config_differs_from_the_default_only_in_the_loss():
    from helpers import REPO

    gspo, grpo = load_config(REPO / "configs/tiny_cpu.yaml"), load_config(REPO / "configs/tiny_cpu_grpo.yaml")
    assert (grpo.loss.function, gspo.loss.function) == ("grpo", "gspo")
    grpo.loss = gspo.loss
    assert grpo == gspo


@pytest.mark.parametrize("override, fragment", [
    ("train.steps=[1", "override 'train.steps=[1': not a valid value"),
    ("train.steps.x=1", "override 'train.steps.x=1': train.steps is not a section"),
])
def test_malformed_override_is_one_config_error(override, fragment):
    with pytest.raises(ConfigError) as err:
        from helpers import REPO

        load_config(REPO / "configs" / "tiny_cpu.yaml", [override])  # train.steps is set there
    assert str(err.value).startswith(fragment) and "\n" not in str(err.value)


def test_config_file_that_is_not_utf8(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("train:\n  steps: 3 # caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="not a UTF-8 text file"):
        load_config(path)


def test_group_of_one_and_bad_mask_settings_are_refused():
    with pytest.raises(ConfigError, match="train.group_size: must be >= 2"):
        load_config(None, ["train.group_size=1"])
    with pytest.raises(ConfigError, match="loss.token_mask_band"):
        load_config(None, ["loss.token_mask_band=[2.0,0.5]"])
    with pytest.raises(ConfigError, match="train.routing_replay: needs rollout.return_routed_experts"):
        load_config(None, ["train.routing_replay=true"])


def test_a_config_typo_answers_before_megatron_is_imported_with_the_field_it_meant(tmp_path):
    """It took 7 s (17 s under load): megatron.core was imported before the config was read; then
    2.6-3 s: torch, through the schema's loss choices and the output-directory check (now 0.5 s)."""
    import subprocess
    import sys

    from helpers import REPO

    script = ("import sys\nfrom gspo_mcore.run.cli import main\nfrom gspo_mcore.common.errors import run_cli\n"
              "code = run_cli(lambda: main(sys.argv[1:]))\n"
              "print(code, [m for m in ('megatron', 'transformers', 'torch') if m in sys.modules])\n")
    for typo, said in (("train.stesp=3", "train.stesp: unknown config field (did you mean train.steps?)"),
                       ("trian.steps=3", "trian: unknown config section (did you mean train?)")):
        proc = subprocess.run([sys.executable, "-c", script, "--config", "configs/tiny_cpu.yaml", "--output-dir",
                               str(tmp_path / "run"), typo], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert proc.stderr.strip().splitlines() == [f"error: {said}"] and proc.stdout.strip() == "2 []", proc.stderr
    assert not (tmp_path / "run").exists()


def test_print_config_shows_the_resolved_config_and_starts_nothing(tmp_path, capsys):
    """`gspo-train --print-config`: the config with its base merged, the overrides applied and
    every default filled in, as YAML that loads back to the same config; exit 0, nothing run."""
    import signal

    from helpers import REPO
    from gspo_mcore.run.cli import main

    overrides = ["train.steps=3", "data.chat_template_kwargs.enable_thinking=false"]
    handler = signal.getsignal(signal.SIGTERM)  # main installs the trainer's own
    try:
        assert main(["--config", str(REPO / "configs/long_cpu.yaml"), "--print-config", *overrides,
                     "--output-dir", str(tmp_path / "run")]) is None
    finally:
        signal.signal(signal.SIGTERM, handler)
    printed = capsys.readouterr().out
    (tmp_path / "resolved.yaml").write_text(printed)
    assert load_config(tmp_path / "resolved.yaml") == load_config(REPO / "configs/long_cpu.yaml", overrides)
    assert "reward:\n  name: gspo_mcore.tasks.long:list_reward\n" in printed and "  clip_low: 0.0003\n" in printed
    assert not (tmp_path / "run").exists()


def test_the_grpo_comparison_commands_use_the_demos_run():
    """configs/tiny_cpu_grpo.yaml's commands plot against the run `make demo` writes."""
    from helpers import REPO
    from gspo_mcore.run.demo import DEFAULT_OUTPUT, train_command

    comment = [line for line in (REPO / "configs/tiny_cpu_grpo.yaml").read_text().splitlines() if line.startswith("#")]
    plot = next(line for line in comment if "gspo_mcore.run.plot" in line).split()
    demo_run = train_command(DEFAULT_OUTPUT, overwrite=False)
    demo_run = Path(demo_run[demo_run.index("--output-dir") + 1])
    assert REPO / plot[plot.index("gspo_mcore.run.plot") + 1] == demo_run
    assert (REPO / plot[plot.index("gspo_mcore.run.plot") + 2]).parent == demo_run.parent


def test_the_config_reference_page_is_generated_from_the_dataclasses():
    """docs/config_reference.md lists every key with its default: regenerate it with
    `python -m gspo_mcore.config.reference --write` when config.py changes."""
    import dataclasses

    from gspo_mcore.config import Config
    from gspo_mcore.config.reference import PAGE, keys, page

    assert PAGE.read_text() == page()
    listed = {key.name for key in keys()}
    for section in dataclasses.fields(Config):
        for f in dataclasses.fields(getattr(Config(), section.name)):
            value = getattr(getattr(Config(), section.name), f.name)
            inner = dataclasses.fields(value) if dataclasses.is_dataclass(value) else ()
            # A section inside a section (reward.code) is listed by its own keys.
            assert all(f"{section.name}.{f.name}.{g.name}" in listed for g in inner) if inner else \
                f"{section.name}.{f.name}" in listed
    assert next(k for k in keys() if k.name == "train.steps").default == Config().train.steps
    assert next(k for k in keys() if k.name == "reward.code.cpu_s").default == Config().reward.code.cpu_s


def test_a_run_reads_the_git_revision_without_locking_the_users_index(tmp_path, monkeypatch):
    """`git status` (the revision in OUTPUT_DIR/config.yaml) rewrote the checkout's index under
    .git/index.lock: a `git commit` of the user's at that moment failed. gspo-train's environment tells
    git not to take optional locks; here a checkout whose index is stale keeps its index file as is."""
    import subprocess

    from helpers import REPO
    from gspo_mcore.run.cli import main
    from gspo_mcore.run.saved_config import provenance

    monkeypatch.delenv("GIT_OPTIONAL_LOCKS", raising=False)
    main(["--config", str(REPO / "configs/tiny_cpu.yaml"), "--print-config"])
    assert "git " in provenance()
    repo = tmp_path / "checkout"
    git = ["git", "-C", str(repo), "-c", "user.email=u@x", "-c", "user.name=u"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "f").write_text("a")
    subprocess.run([*git, "add", "f"], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    index = repo / ".git" / "index"
    os.utime(repo / "f", (index.stat().st_mtime + 5,) * 2)  # stale stat data: status would refresh the index
    before = index.stat().st_mtime_ns
    subprocess.run([*git, "status", "--porcelain"], check=True, capture_output=True)  # as provenance() runs it
    assert index.stat().st_mtime_ns == before


@pytest.mark.parametrize(
    "overrides",
    [
        ["optimizer.precision_aware=true"],  # on CPU: TE's FusedAdam is CUDA only
        ["distributed.device=cuda", "model.dtype=bfloat16", "optimizer.precision_aware=true",
         "optimizer.distributed_optimizer=false"],  # Megatron asserts the distributed optimizer
        ["distributed.device=cuda", "model.dtype=bfloat16", "optimizer.precision_aware=true", "optimizer.name=sgd"],
        ["distributed.device=cuda", "optimizer.precision_aware=true"],  # float32 weights: no bf16 moments to save
    ],
)
def test_the_precision_aware_optimizer_where_megatron_refuses_it_is_one_line(overrides):
    with pytest.raises(ConfigError, match=r"^optimizer.precision_aware: needs distributed.device 'cuda' \(Transformer "
                                          r"Engine's FusedAdam\), optimizer.distributed_optimizer, optimizer.name "
                                          r"'adam' and model.dtype 'bfloat16'$"):
        load_config(None, overrides)


def test_the_precision_aware_optimizer_and_cpu_offload_are_one_or_the_other():
    gpu = ["distributed.device=cuda", "model.dtype=bfloat16"]
    with pytest.raises(ConfigError, match=r"^optimizer.precision_aware: keeps bf16 Adam moments on the GPU, "
                                          r"optimizer.cpu_offload fp32 ones on the host: set one$"):
        load_config(None, [*gpu, "optimizer.precision_aware=true", "optimizer.cpu_offload=true"])
    assert load_config(None, [*gpu, "optimizer.precision_aware=true"]).optimizer.precision_aware


PRECISION_AWARE_GPU = ["distributed.device=cuda", "model.dtype=bfloat16", "optimizer.precision_aware=true"]


def test_the_precision_aware_optimizer_without_transformer_engine_is_refused_before_anything_is_built(monkeypatch):
    """check_installed (Learner's first statement): refused in one line naming the field, found by
    module lookup alone; Megatron's own refusal came after the model and DDP, ~10 GB that stayed on
    the GPU. Loading the config still works: the planner plans it where TE is not installed."""
    import sys
    import types

    from gspo_mcore.config.validate import check_installed

    config = load_config(None, PRECISION_AWARE_GPU)
    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # not importable
    with pytest.raises(ConfigError, match=r"^optimizer.precision_aware: needs Transformer Engine's FusedAdam "
                                          r"\(transformer_engine\), not installed here; set it false$"):
        check_installed(config)
    check_installed(load_config(None, ["distributed.device=cuda", "model.dtype=bfloat16"]))  # not asked for: no lookup
    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))  # a stand-in
    check_installed(config)


def test_the_installed_check_imports_nothing_heavy():
    """A config check at load time: no torch, no Transformer Engine import."""
    import subprocess
    import sys

    from helpers import REPO, environment

    code = ("import sys; from gspo_mcore.config import load_config; from gspo_mcore.config.validate import "
            "check_installed\ntry: check_installed(load_config(None, %r))\nexcept Exception: pass\n"
            "print(sorted(m for m in ('torch', 'transformer_engine') if m in sys.modules))" % PRECISION_AWARE_GPU)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                          env=environment())
    assert proc.stdout.strip() == "[]", proc.stdout + proc.stderr[-2000:]


def test_help_config_lists_every_key_with_its_default_and_meaning(capsys):
    """`gspo-train --help-config`: every key of the schema, its type and default, whether a resume
    may change it, and its doc string; like --help it needs no --config and exits 0."""
    from gspo_mcore.run.cli import parse_args
    from gspo_mcore.config.reference import keys

    with pytest.raises(SystemExit) as stop:
        parse_args(["--help-config"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    heads = [line for line in out.splitlines() if not line.startswith("    ")]
    assert [line.split(" (", 1)[0] for line in heads] == [key.name for key in keys()]
    assert all(key.doc for key in keys()), [key.name for key in keys() if not key.doc]  # every field has its doc
    assert "train.group_size (int, default 8)\n    Responses per prompt (the group GSPO normalises advantages over).\n" in out
    assert "optimizer.lr (float, default 1.0e-06, resume)\n" in out
    assert "reward.code.cpu_s (float, default 4.0)\n    CPU seconds per test" in out


@pytest.mark.parametrize("section, values, message", [
    ("TrainConfig", {"group_size": 1}, "train.group_size: must be >= 2"),
    ("RolloutConfig", {"temperature": 0.0}, "rollout.temperature: must be > 0"),
    ("RolloutConfig", {"max_staleness": -1}, "rollout.max_staleness: must be >= 0"),
    ("LossConfig", {"behavior_weight_cap": 0.5}, "loss.behavior_weight_cap: must be >= 1"),
    ("WeightSyncConfig", {"method": "tensor"}, "weight_sync.method: 'tensor' needs weight_sync.colocate"),
    ("DistributedConfig", {"timeout_minutes": 0}, "distributed.timeout_minutes: must be > 0"),
])
def test_each_section_checks_its_own_fields(section, values, message):
    """A section's check reads that section alone (gspo_mcore.config.schema), and a whole config
    with that section refuses to load with the same line."""
    import dataclasses

    from gspo_mcore.config import schema

    cls = getattr(schema, section)
    with pytest.raises(ConfigError, match=f"^{message}"):
        cls(**values).check()
    name = next(f.name for f in dataclasses.fields(Config) if f.type in (section, cls))
    with pytest.raises(ConfigError, match=f"^{message}"):
        load_config(None, [f"{name}.{key}={value}" for key, value in values.items()])


def test_checks_across_sections_pass_each_section_alone():
    """What needs two sections is gspo_mcore.config.validate's: each section passes its own check."""
    config = Config()
    config.rollout.mode, config.reward.norm = "async", "batch"
    config.rollout.check(), config.reward.check()
    with pytest.raises(ConfigError, match="^reward.norm: 'batch' has no batch in rollout.mode 'async'"):
        config.validate()


# ------------------------------------------------------------------ #47 item 5
def test_the_gradient_buffers_are_given_back_only_to_a_colocated_engine():
    """optimizer.offload_grad_buffers makes room for an engine on the trainer's GPUs: with split
    engines it would only cost a reallocation a step, so it is refused in one line. Colocated, it
    goes with every optimizer: precision-aware, fp32 Adam on the GPU, and the host-offloaded one
    (Megatron's HybridDeviceOptimizer reads the gradients afresh at each step:
    hybrid_optimizer.py, `getattr(param, "decoupled_grad", param.grad)`), on CPU as on CUDA."""
    with pytest.raises(ConfigError, match=r"^optimizer.offload_grad_buffers: gives the gradient buffers to a "
                                          r"colocated engine while it generates: needs weight_sync.colocate$"):
        load_config(None, ["optimizer.offload_grad_buffers=true"])
    colocated = ["weight_sync.colocate=true", "weight_sync.method=disk", "optimizer.offload_grad_buffers=true"]
    assert load_config(None, colocated).optimizer.offload_grad_buffers  # CPU: the storage resize works there too
    gpu = ["distributed.device=cuda", "model.dtype=bfloat16", *colocated]
    for optimizer in (["optimizer.precision_aware=true"], [], ["optimizer.cpu_offload=true"]):
        assert load_config(None, [*gpu, *optimizer]).optimizer.offload_grad_buffers
    assert not load_config(None).optimizer.offload_grad_buffers  # off unless a config says so


def test_the_30b_configs_run_precision_aware_with_the_gradients_given_back_where_colocated():
    """#47 item 5: every 30B config that shares its GPUs with the engine runs the precision-aware
    optimizer and gives the gradient buffers back during rollout; a split one keeps them; the
    one-node async config (EP 4) and the 235B one keep Adam on the host (tests/test_plan.py: why)."""
    configs = Path(__file__).resolve().parents[1] / "configs"
    for path in sorted(configs.glob("qwen3_*.yaml")):
        config = load_config(path)
        opt = config.optimizer
        assert opt.offload_grad_buffers == config.weight_sync.colocate, path.name
        offloaded = path.name in ("qwen3_235b_a22b_gspo.yaml", "qwen3_30b_a3b_gspo_async_1node.yaml",
                                  "qwen3_30b_a3b_gspo_async_1node_vllm.yaml")
        assert (opt.cpu_offload, opt.precision_aware) == (offloaded, not offloaded), path.name


def test_old_keys_the_docs_showed_work_with_a_dated_warning():
    """loss.level=token (the claim grid's docs showed it) and the keys that moved section: the
    config they meant, each with a warning naming the key now and the release that drops it; an
    old key beside its new one with another value, or a level that never was, is one line."""
    from gspo_mcore.common.deprecation import REMOVED_AFTER, MovedWarning

    with pytest.warns(MovedWarning, match=rf"config key loss.level is loss.function now: write loss.function: grpo "
                                          rf"\(the old key works until {REMOVED_AFTER}\)"):
        assert load_config(None, ["loss.level=token"]).loss.function == "grpo"
    with pytest.warns(MovedWarning, match="loss.temperature is rollout.temperature now"):
        assert load_config(None, ["loss.temperature=0.7"]).rollout.temperature == 0.7
    with pytest.warns(MovedWarning, match="train.group_filter is rollout.group_filter now"):
        assert load_config(None, ["train.group_filter=all"]).rollout.group_filter == "all"
    with pytest.raises(ConfigError, match=r"^loss.level: 'tokens' is not one of \['sequence', 'sequence_token', 'token'\]"):
        load_config(None, ["loss.level=tokens"])
    with pytest.raises(ConfigError, match=r"^loss.temperature: 0.7 beside rollout.temperature: 0.9; write "
                                          r"rollout.temperature alone$"):
        load_config(None, ["loss.temperature=0.7", "rollout.temperature=0.9"])
