"""checkpoint_convert: HF <-> Megatron-Core torch_dist, streaming, atomic, exact."""

import json
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoint_convert import convert
from checkpoint_convert.dcp_io import DCPReader
from gspo_mcore.common.safetensors_io import HFCheckpointReader
from checkpoint_convert.synthetic import QWEN3_30B_A3B, QWEN3_235B_A22B, write_synthetic_checkpoint
from conftest import plan_layout_job
from helpers import REPO, last_json_line, run_module
from gspo_mcore.common.errors import InputError
from gspo_mcore.megatron.qwen3_moe.tiny import make_tiny_checkpoint

# Slow (`slow` on each): those that run the converter CLI or torchrun in subprocesses.


def cli(*args, check=True):
    proc = subprocess.run([sys.executable, "-m", "checkpoint_convert", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=300)
    if check and proc.returncode != 0:
        pytest.fail(f"checkpoint_convert {' '.join(args)} exited {proc.returncode}\n{proc.stderr[-4000:]}")
    return proc


def assert_same_checkpoint(a, b):
    ra, rb = HFCheckpointReader(a), HFCheckpointReader(b)
    assert set(ra.keys()) == set(rb.keys())
    for name in ra.keys():
        ta, tb = ra[name], rb[name]
        assert ta.dtype == tb.dtype and torch.equal(ta, tb), name


@pytest.fixture(scope="module")
def converted(tiny_hf_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("conv") / "mcore"
    cli("hf-to-mcore", "--hf-dir", str(tiny_hf_dir), "--output-dir", str(out), "--quiet")
    return out


@pytest.mark.slow
def test_output_has_the_files_megatron_lm_expects(converted):
    assert (converted / "latest_checkpointed_iteration.txt").read_text() == "release"
    release = converted / "release"
    assert {".metadata", "common.pt", "metadata.json"} <= {p.name for p in release.iterdir()}
    assert list(release.glob("*.distcp"))
    assert json.loads((release / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    assert not list(converted.parent.glob("*.tmp-*"))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_round_trip_is_bitwise(tmp_path, dtype):
    hf = make_tiny_checkpoint(tmp_path / "hf", seed=5, dtype=dtype)
    cli("hf-to-mcore", "--hf-dir", str(hf), "--output-dir", str(tmp_path / "mcore"), "--quiet")
    cli("mcore-to-hf", "--mcore-dir", str(tmp_path / "mcore"), "--hf-config-dir", str(hf),
        "--output-dir", str(tmp_path / "back"), "--quiet")
    assert_same_checkpoint(hf, tmp_path / "back")
    back = tmp_path / "back"
    index = json.loads((back / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in back.glob("model-*.safetensors"))
    assert shards == sorted(set(index["weight_map"].values())) and shards[-1].endswith(f"-of-{len(shards):05d}.safetensors")
    assert (back / "config.json").read_text() == (hf / "config.json").read_text()


@pytest.mark.slow
def test_dtype_cast(tiny_hf_dir, tmp_path):
    cli("hf-to-mcore", "--hf-dir", str(tiny_hf_dir), "--output-dir", str(tmp_path / "m"), "--dtype", "bf16", "--quiet")
    reader = DCPReader(tmp_path / "m" / "release")
    qkv = reader.read("decoder.layers.0.self_attention.linear_qkv.weight")
    assert qkv.dtype == torch.bfloat16
    hf = HFCheckpointReader(tiny_hf_dir)
    assert torch.equal(reader.read("embedding.word_embeddings.weight"), hf["model.embed_tokens.weight"].to(torch.bfloat16))
    figures = last_json_line(cli("verify", "--hf-dir", str(tiny_hf_dir), "--mcore-dir", str(tmp_path / "m")).stdout)
    assert figures["ok"] and figures["weights_rounded_to"] == "bfloat16"  # a float32 model, compared as converted


# Megatron's own saves and the converter's output loaded under parallel layouts: jobs of the
# layouts' shared torchrun launches (conftest.layout_output), no launch of their own.
plan_layout_job("save_mcore", "save_mcore", ["single", "EP2"])
plan_layout_job("save_mcore_torch", "save_mcore", ["EP2"], ["model.spec=torch"])
plan_layout_job("parity_converted", "parity_converted", ["EP2", "PP2", "TP2-SP"])
plan_layout_job("parity_converted_torch", "parity_converted", ["EP2"], ["model.spec=torch"])


@pytest.mark.parametrize("layout, job", [("single", "save_mcore"), ("EP2", "save_mcore_torch")],
                         ids=["local", "torch-EP2"])
def test_same_checkpoint_as_megatron_saves(tiny_hf_dir, converted, layout_output, layout, job):
    """Keys, global shapes, dtypes and values equal those of Megatron's own save of the model
    (the local spec; the converter adds the extra states of the TE spec's standalone norms), and
    of the torch spec's stacked experts saved from two expert-parallel ranks: one checkpoint."""
    from checkpoint_convert.convert import local_spec_aliases, te_norm_extra_state_keys
    from gspo_mcore.megatron.qwen3_moe.hf_config import load_hf_config

    ours = DCPReader(converted / "release")
    megatron = DCPReader(layout_output(layout, job) / "saved" / "iter_0000001")
    ours_md, theirs_md = ours.metadata.state_dict_metadata, megatron.metadata.state_dict_metadata
    arch = load_hf_config(tiny_hf_dir)
    te_only = {key for layer in [None, *range(arch.num_layers)] for key in te_norm_extra_state_keys(arch, layer)}
    assert te_only and not te_only & set(theirs_md)
    aliases = {a: key for layer in range(arch.num_layers) for a, key in local_spec_aliases(arch, layer).items()}
    assert aliases and not aliases.keys() & set(theirs_md)
    assert set(ours_md) == set(theirs_md) | te_only | aliases.keys()
    for alias, key in aliases.items():
        assert torch.equal(ours.read(alias), ours.read(key)), alias
    for key, meta in theirs_md.items():
        assert type(ours_md[key]) is type(meta), key
        if hasattr(meta, "size"):
            assert ours_md[key].size == meta.size and ours_md[key].properties.dtype == meta.properties.dtype, key
            assert torch.equal(ours.read(key), megatron.read(key)), key


@pytest.mark.parametrize("layout, job", [("EP2", "parity_converted"), ("PP2", "parity_converted"),
                                         ("TP2-SP", "parity_converted"), ("EP2", "parity_converted_torch")],
                         ids=["EP2", "PP2", "TP2-SP", "EP2-torch-spec"])
def test_converted_checkpoint_loads_under_layouts(layout_output, layout, job):
    figures = json.loads((layout_output(layout, job) / "figures.json").read_text())
    assert figures["max_abs_logit_diff"] <= 1e-4 and figures["export_bitwise_identical"], figures


def test_trainer_checkpoint_under_ep2_back_to_hf(tiny_hf_dir, layout_output, tmp_path):
    """A checkpoint Megatron saved with experts split over 2 ranks: every expert comes back."""
    cli("mcore-to-hf", "--mcore-dir", str(layout_output("EP2", "save_mcore") / "saved"), "--hf-config-dir",
        str(tiny_hf_dir), "--output-dir", str(tmp_path / "back"), "--quiet")
    assert_same_checkpoint(tiny_hf_dir, tmp_path / "back")


@pytest.mark.slow
def test_verify_passes_and_fails(tiny_hf_dir, converted, tmp_path):
    proc = cli("verify", "--hf-dir", str(tiny_hf_dir), "--mcore-dir", str(converted))
    figures = last_json_line(proc.stdout)
    assert figures["ok"] and figures["max_abs_logit_diff"] <= figures["tolerance"] == 1e-4
    assert figures["top1_agreement"] == 1.0 and set(figures["per_layer_max_weight_diff"]) >= {"layer_0", "layer_3"}
    assert figures["weights_rounded_to"] == "float32"  # the dtype the checkpoint stores, which both sides used
    other = make_tiny_checkpoint(tmp_path / "other", seed=9)  # same shapes, other weights
    proc = cli("verify", "--hf-dir", str(other), "--mcore-dir", str(converted), check=False)
    assert proc.returncode == 1 and last_json_line(proc.stdout)["ok"] is False


SMALL = {"hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 2,
         "vocab_size": 512}


@pytest.mark.parametrize("shape", [QWEN3_30B_A3B, QWEN3_235B_A22B], ids=["30B-A3B", "235B-A22B"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_real_model_structure_round_trip(tmp_path, shape, dtype):
    """128 experts, top-8, head_dim 128, 4 KV heads (32 or 64 query heads), small hidden sizes."""
    hf = write_synthetic_checkpoint(tmp_path / "hf", {**shape, **SMALL}, dtype=dtype)
    convert.hf_to_mcore(hf, tmp_path / "mcore", quiet=True)
    assert DCPReader(tmp_path / "mcore" / "release").shape("decoder.layers.1.mlp.experts.experts.linear_fc1.weight") == (128, 64, 64)
    convert.mcore_to_hf(tmp_path / "mcore", hf, tmp_path / "back", quiet=True)
    assert_same_checkpoint(hf, tmp_path / "back")


# ---- bad input: one line, exit 2, nothing written -------------------------------------------


def assert_rejected(proc, out, *fragments):
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert not out.exists() and not list(out.parent.glob(f"{out.name}.tmp-*"))


@pytest.fixture
def hf_copy(tiny_hf_dir, tmp_path):
    out = tmp_path / "hf"
    shutil.copytree(tiny_hf_dir, out)
    return out


def to_mcore(hf, out, *extra):
    return cli("hf-to-mcore", "--hf-dir", str(hf), "--output-dir", str(out), "--quiet", *extra, check=False)


@pytest.mark.slow
def test_missing_config(hf_copy, tmp_path):
    (hf_copy / "config.json").unlink()
    assert_rejected(to_mcore(hf_copy, tmp_path / "out"), tmp_path / "out", "config.json not found")


@pytest.mark.slow
def test_not_qwen3_moe(hf_copy, tmp_path):
    cfg = json.loads((hf_copy / "config.json").read_text())
    cfg.update(model_type="qwen3", architectures=["Qwen3ForCausalLM"])
    (hf_copy / "config.json").write_text(json.dumps(cfg))
    assert_rejected(to_mcore(hf_copy, tmp_path / "out"), tmp_path / "out", "is not Qwen3-MoE")


def _edit_tensors(hf, fn):
    tensors = load_file(hf / "model.safetensors")
    fn(tensors)
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.slow
def test_missing_tensor(hf_copy, tmp_path):
    _edit_tensors(hf_copy, lambda t: t.pop("model.layers.3.mlp.experts.5.down_proj.weight"))
    assert_rejected(to_mcore(hf_copy, tmp_path / "out"), tmp_path / "out",
                    "missing tensor 'model.layers.3.mlp.experts.5.down_proj.weight'")


@pytest.mark.slow
def test_wrong_shape(hf_copy, tmp_path):
    def bad(t):
        t["model.layers.2.self_attn.k_proj.weight"] = torch.zeros(48, 64)

    _edit_tensors(hf_copy, bad)
    assert_rejected(to_mcore(hf_copy, tmp_path / "out"), tmp_path / "out",
                    "'model.layers.2.self_attn.k_proj.weight' has shape [48, 64], expected [64, 64]")


@pytest.mark.slow
def test_truncated_safetensors(hf_copy, tmp_path):
    data = (hf_copy / "model.safetensors").read_bytes()
    (hf_copy / "model.safetensors").write_bytes(data[: len(data) // 3])
    assert_rejected(to_mcore(hf_copy, tmp_path / "out"), tmp_path / "out", "model.safetensors")


@pytest.mark.slow
def test_output_exists_unless_overwrite(tiny_hf_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("x")
    proc = to_mcore(tiny_hf_dir, out)
    assert proc.returncode == 2 and "output directory exists" in proc.stderr and (out / "keep").exists()
    assert to_mcore(tiny_hf_dir, out, "--overwrite").returncode == 0
    assert not (out / "keep").exists() and (out / "release" / ".metadata").is_file()


def test_not_enough_disk_space(tiny_hf_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10 << 30, 10 << 30, 1 << 20))
    with pytest.raises(InputError, match="not enough disk space"):
        convert.hf_to_mcore(tiny_hf_dir, tmp_path / "out", quiet=True)
    assert list(tmp_path.iterdir()) == []


def test_failure_midway_leaves_nothing(tiny_hf_dir, tmp_path, monkeypatch):
    calls = {"n": 0}
    original = convert.DCPWriter.write_tensor

    def failing(self, *args):
        calls["n"] += 1
        if calls["n"] == 20:
            raise OSError("disk went away")
        return original(self, *args)

    monkeypatch.setattr(convert.DCPWriter, "write_tensor", failing)
    with pytest.raises(OSError):
        convert.hf_to_mcore(tiny_hf_dir, tmp_path / "out", quiet=True)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_killed_run_leaves_no_valid_looking_output(tmp_path):
    hf = write_synthetic_checkpoint(tmp_path / "hf", {**QWEN3_30B_A3B, **SMALL, "hidden_size": 256,
                                                      "num_hidden_layers": 24})
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "checkpoint_convert", "hf-to-mcore", "--hf-dir", str(hf),
                             "--output-dir", str(out), "--quiet"], cwd=REPO)
    deadline = time.time() + 120
    while not list(tmp_path.glob("out.tmp-*/release/__1_0.distcp")) and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not out.exists()  # only out.tmp-<pid> may remain, which no reader takes for a checkpoint


def _peak_rss_mb(hf, out) -> float:
    # VmHWM: ru_maxrss would carry over the (large) RSS of this pytest process across fork+exec.
    code = ("import sys\nfrom checkpoint_convert.convert import hf_to_mcore\n"
            "hf_to_mcore(sys.argv[1], sys.argv[2], quiet=True)\n"
            "print(next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM:')) / 1024)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(hf), str(out)], capture_output=True, text=True,
                          cwd=REPO, check=True)
    return float(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_peak_memory_does_not_grow_with_layers(tmp_path):
    big = {**QWEN3_30B_A3B, **SMALL, "hidden_size": 256, "moe_intermediate_size": 128}  # ~25 MB per layer
    few = write_synthetic_checkpoint(tmp_path / "few", {**big, "num_hidden_layers": 2})
    many = write_synthetic_checkpoint(tmp_path / "many", {**big, "num_hidden_layers": 12})
    layer_mb = sum(p.stat().st_size for p in many.glob("model-00002-*")) / 2**20
    rss_few, rss_many = _peak_rss_mb(few, tmp_path / "m1"), _peak_rss_mb(many, tmp_path / "m2")
    # 10 more layers (~250 MB) may cost at most about one more layer of resident memory.
    assert rss_many - rss_few < 1.5 * layer_mb + 20, (rss_few, rss_many, layer_mb)
    assert rss_many < 600, rss_many  # interpreter + torch (~270 MB) + about one layer


@pytest.mark.slow
def test_progress_bar_on_stderr_unless_quiet(tiny_hf_dir, tmp_path):
    proc = cli("hf-to-mcore", "--hf-dir", str(tiny_hf_dir), "--output-dir", str(tmp_path / "m"))
    assert "hf-to-mcore: 113/113 tensors" in proc.stderr and "MB/s" in proc.stderr and "ETA" in proc.stderr
    quiet = cli("hf-to-mcore", "--hf-dir", str(tiny_hf_dir), "--output-dir", str(tmp_path / "q"), "--quiet")
    assert quiet.stderr == ""


@pytest.mark.slow
def test_mcore_to_hf_with_the_wrong_config_names_the_tensor(converted, tmp_path):
    other = write_synthetic_checkpoint(tmp_path / "other", {**QWEN3_30B_A3B, **SMALL})
    out = tmp_path / "back"
    proc = cli("mcore-to-hf", "--mcore-dir", str(converted), "--hf-config-dir", str(other),
               "--output-dir", str(out), check=False)
    assert_rejected(proc, out, "embedding.word_embeddings.weight", "has shape [256, 64], expected [512, 64]")


@pytest.mark.slow
def test_truncated_distcp_is_named_and_leaves_nothing(converted, tiny_hf_dir, tmp_path):
    broken = tmp_path / "mcore"
    shutil.copytree(converted, broken)
    data_file = broken / "release" / "__2_0.distcp"
    data_file.write_bytes(data_file.read_bytes()[:1000])
    out = tmp_path / "back"
    proc = cli("mcore-to-hf", "--mcore-dir", str(broken), "--hf-config-dir", str(tiny_hf_dir),
               "--output-dir", str(out), "--quiet", check=False)
    assert_rejected(proc, out, "__2_0.distcp")


@pytest.mark.slow
def test_megatron_own_local_specs_load_the_output_strictly(tiny_hf_dir, converted):
    """A Megatron user's GPTModel from get_gpt_decoder_block_spec(use_transformer_engine=False)
    or get_gpt_layer_local_spec loads our checkpoint with a default (strict) load and gives the
    HF logits (it used to fail: 'decoder.layers.0.mlp.linear_fc1.layer_norm_weight from model
    not in state dict')."""
    proc = run_module(["tests/workers/megatron_own_spec.py", str(tiny_hf_dir), str(converted)])
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["spec"] for r in results] == ["get_gpt_decoder_block_spec", "get_gpt_layer_local_spec"]
    for r in results:
        assert r["max_abs_logit_diff"] <= 1e-4, r
