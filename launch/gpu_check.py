"""The one-GPU check to run first, on any CUDA machine with PyTorch, before building the image:

    python launch/gpu_check.py [--wheels DIR] [--work DIR] [--only N ...] [--device cuda|cpu]

It needs only Python 3.11 or 3.12, a CUDA PyTorch >= 2.11, `transformers` >= 5.17, this
repository and the wheel folder `launch/wheelhouse.sh DIR` fills (megatron-core 0.16.1 and the
few packages the trainer imports besides torch and transformers, plus vLLM 0.33's
`packed_tensor.py`): they go on sys.path here, without pip (the machine's Python may be
externally managed, and pip would fetch another torch). Offline.

Each section prints one JSON line: {"section": N, "name": ..., "result": "PASS" | "FAIL" |
"SKIP", figures...}; the exit status is 1 when any failed. `--device cpu` (the default without
CUDA) runs every section that can run on CPU at a tiny shape: tests/test_gpu_check.py runs it.

1. imports and environment: torch, CUDA, NCCL, the GPU's UUID, where megatron-core came from;
2. Qwen3-30B-A3B's layer shapes (128 experts top-8, hidden 2048, 32/4 heads of 128, expert FFN
   768, vocabulary 151,936) at 2 layers, `spec: local`, a synthetic checkpoint (~3.7 GB, written
   once into WORK): float32 logits against `transformers` on the same device
   (gspo_mcore.megatron.parity.run) and the HF export bitwise the checkpoint's;
3. GSPO updates in bf16 with configs/qwen3_30b_a3b_gspo.yaml's optimizer, recompute and loss
   (gspo_mcore.megatron.learner.Learner), the second one timed: finite loss and gradient norm, weights
   moved, the peak GPU memory against the planner's estimate for the same shape (within
   gspo_mcore.planner.cli.ESTIMATE_TOLERANCE), training tokens/s and MFU; beside it (CUDA, with Transformer
   Engine: its FusedAdam runs it) the same with Megatron's precision-aware optimizer
   (optimizer.precision_aware: bf16 moments on the GPU, no offload), step time and peak side by side;
4. a torch_dist save (gspo_mcore.megatron.checkpointing.Checkpointer), then a fresh process resumes it:
   every parameter and optimizer state equal (hashes), and a second update runs;
5. (CUDA) the colocated CUDA-IPC push as the trainer makes it (gspo_mcore.engines.vllm:
   pack_bucket, shared_payload) to a stand-in server process that maps it as vLLM 0.33's IPC
   engine does and reads it with vLLM's own `packed_tensor.unpack_tensor`: every tensor equal,
   the trainer's memory back to its start after two pushes;
6. (CUDA) the NCCL calls of vLLM's NCCL push (gspo_mcore.engines.vllm.nccl): the communicator
   joined on a thread of its own on this rank's device, a 1 GiB broadcast, world of one;
7. the sync check (gspo_mcore.weight_sync.check_sync) against a stand-in server process that
   answers vLLM 0.33's prompt log-probs with `transformers`, float32: within the tolerance against
   the weights a learner just wrote as the disk push does, over 10x further from the stale ones.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WHEELS = REPO / "launch" / "wheels"  # launch/wheelhouse.sh's default folder
SECTIONS = {1: "imports and environment", 2: "Qwen3-30B-A3B layer shapes: logits parity and HF export",
            3: "GSPO updates at the 30B settings, offloaded and precision-aware: memory against the planner",
            4: "torch_dist save and resume",
            5: "colocated CUDA-IPC push read by vLLM's packed_tensor", 6: "NCCL push calls on a joining thread",
            7: "weight-sync check against a stand-in engine"}
H100_BF16_TFLOPS = 989.0  # dense bf16 peak of an H100 SXM, for the MFU printed


# ---------------------------------------------------------------- the wheel folder, without pip

def wheel_paths(folder: Path, cache: Path) -> list[Path]:
    """What to put on sys.path for the wheels in `folder`: a wheel of pure Python is imported from
    the zip itself (zipimport); one with compiled parts (WHEEL: Root-Is-Purelib: false, e.g.
    megatron-core's dataset helpers) is unpacked once into `cache` (a shared library cannot be
    loaded from a zip). The folder itself too: it holds vLLM's packed_tensor.py."""
    paths = []
    for wheel in sorted(folder.glob("*.whl")):
        with zipfile.ZipFile(wheel) as archive:
            meta = next(n for n in archive.namelist() if n.endswith(".dist-info/WHEEL"))
            pure = "root-is-purelib: true" in archive.read(meta).decode().lower()
            compiled = any(n.endswith((".so", ".pyd")) for n in archive.namelist())
            if pure and not compiled:
                paths.append(wheel)
                continue
            target = cache / wheel.stem
            if not (target / ".complete").exists():
                archive.extractall(target)
                (target / ".complete").touch()
            paths.append(target)
    return paths + [folder]


def use_wheels(folder: Path) -> list[str]:
    """The wheel folder ahead of everything installed (its megatron-core is the one pinned)."""
    if not folder.is_dir():
        return []
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "gspo_gpu_check"
    paths = [str(p) for p in wheel_paths(folder, cache)]
    sys.path[:0] = paths
    return paths


def bridge_missing_transformer_engine() -> None:
    """megatron-core 0.16.1's OptimizerConfig, with use_precision_aware_optimizer (which the 30B
    config's CPU offload sets: gspo_mcore.megatron.optimizer.setup_training), compares Transformer Engine's
    version even when TE is absent (megatron/core/utils.py get_te_version returns None, and
    `None >= Version` raises TypeError). A bare machine has no TE (the image has): version 0, so no
    TE feature applies and the offloaded optimizer is Megatron's HybridDeviceOptimizer as in the image."""
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        import megatron.core.utils
        from packaging.version import Version

        megatron.core.utils._te_version = Version("0")


# ---------------------------------------------------------------- shapes

QWEN3_30B_2_LAYERS = "qwen3_30b_a3b"
TINY = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
        "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
        "num_hidden_layers": 2}


class Shape:
    """The model and the batch of one device: the real widths at 2 layers and the 30B config's
    16k-token microbatch on CUDA; a tiny model on CPU."""

    def __init__(self, device: str):
        from checkpoint_convert.synthetic import QWEN3_30B_A3B

        self.device = device
        if device == "cuda":
            self.hf = {**QWEN3_30B_A3B, "num_hidden_layers": 2}
            self.sequences, self.prompt, self.response = 4, 96, 4000  # 4 x 4096 = one 16,384-token microbatch
            self.parity_batch, self.parity_len = 2, 128
        else:
            self.hf = {**QWEN3_30B_A3B, **TINY}
            self.sequences, self.prompt, self.response = 4, 8, 24
            self.parity_batch, self.parity_len = 2, 16

    @property
    def tokens(self) -> int:
        return self.sequences * (self.prompt + self.response)


def make_inputs(work: Path, shape: Shape) -> Path:
    """The synthetic checkpoint (written once per shape) and a one-line prompt file the config names."""
    from checkpoint_convert.synthetic import write_synthetic_checkpoint

    hf_dir = work / f"synthetic_{shape.device}"
    if not (hf_dir / "model.safetensors.index.json").exists():
        write_synthetic_checkpoint(hf_dir, shape.hf)
    prompts = work / "prompts.jsonl"
    if not prompts.exists():
        prompts.write_text(json.dumps({"prompt": "1 + 1 = ?", "answer": "2"}) + "\n")
    return hf_dir


def check_config(work: Path, shape: Shape, hf_dir: Path, dtype: str, extra=()):
    """configs/qwen3_30b_a3b_gspo.yaml on this one device: the synthetic model, `spec: local`
    (Transformer Engine is not on a bare machine), EP 1, one minibatch of the check's batch."""
    from gspo_mcore.config import load_config

    overrides = [f"model.hf_dir={hf_dir}", "model.mcore_dir=null", "model.spec=local", f"model.dtype={dtype}",
                 f"distributed.device={shape.device}", "distributed.expert_parallel=1",
                 f"data.path={work / 'prompts.jsonl'}", f"data.tokenizer_dir={hf_dir}", "eval.datasets=[]",
                 "train.num_minibatches=1", "train.rollout_batch_size=1", f"train.group_size={shape.sequences}",
                 f"train.max_tokens_per_microbatch={shape.tokens}", f"rollout.max_new_tokens={shape.response}",
                 "weight_sync.method=disk", "rollout.num_servers=1", "rollout.engine_tp=1"]
    if shape.device == "cpu":
        overrides.append("optimizer.cpu_offload=false")  # Megatron's HybridDeviceOptimizer is CUDA only
    return load_config(REPO / "configs/qwen3_30b_a3b_gspo.yaml", [*overrides, *extra])


def free_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- sections

def section_1(args, shape) -> dict:
    import torch
    import transformers

    import megatron.core

    figures = {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
               "megatron_core": getattr(megatron.core, "__version__", None),
               "megatron_from": str(Path(megatron.core.__file__).parents[2]), "cuda": torch.version.cuda,
               "device": shape.device}
    if shape.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        figures.update(gpu=props.name, gpu_uuid=str(props.uuid), gpu_memory_gb=props.total_memory / 2**30,
                       nccl=".".join(map(str, torch.cuda.nccl.version()[:3])))
    torch_ok = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 11)
    transformers_ok = tuple(int(p) for p in transformers.__version__.split(".")[:2]) >= (5, 17)
    figures["pass"] = torch_ok and transformers_ok and figures["megatron_core"] == "0.16.1"
    return figures


def section_2(args, shape) -> dict:
    import torch

    from gspo_mcore.megatron.parity import run, sample_tokens

    hf_dir = make_inputs(args.work, shape)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # float32 means float32
    config = check_config(args.work, shape, hf_dir, "float32")
    tokens = sample_tokens(shape.hf["vocab_size"], shape.parity_batch, shape.parity_len)
    figures = run(config, tokens)
    free_memory()
    # float32 on both sides: rounding-level differences (a router near-tie may flip one expert).
    figures["pass"] = (figures["export_bitwise_identical"] and figures["top1_agreement"] >= 0.99
                       and figures["mean_abs_logit_diff"] <= 1e-3 * max(figures["logit_std"], 1e-6))
    return figures


def synthetic_rollouts(shape: Shape, seed: int = 0):
    """The check's batch: random prompts and responses of the shape, each response token with an
    engine log-prob near the policy's (theta = theta_old: the first minibatch is on-policy)."""
    import torch

    from gspo_mcore.batch.rollout import Rollout

    g = torch.Generator().manual_seed(seed)
    vocab = shape.hf["vocab_size"]
    rollouts = [Rollout(torch.randint(0, vocab, (shape.prompt,), generator=g).tolist(),
                        torch.randint(0, vocab, (shape.response,), generator=g).tolist(),
                        [-math.log(vocab)] * shape.response, "stop", "step-0") for _ in range(shape.sequences)]
    advantages = [1.0 if i % 2 else -1.0 for i in range(shape.sequences)]
    return rollouts, advantages


def param_digest(model) -> dict[str, str]:
    import hashlib

    return {name: hashlib.sha256(p.detach().float().cpu().numpy().tobytes()).hexdigest()[:16]
            for name, p in model.named_parameters()}


def optimizer_digest(optimizer) -> dict[str, str]:
    """Per kind of optimizer state (the fp32 main weights, each Adam state), one hash over every
    tensor of it, in order."""
    import hashlib

    import torch

    hashes: dict[str, object] = {}
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", sub)
        for group in inner.param_groups:
            for p in group["params"]:
                for key, value in [("main", p), *sorted(inner.state.get(p, {}).items())]:
                    if isinstance(value, torch.Tensor):
                        hashes.setdefault(key, hashlib.sha256()).update(value.detach().float().cpu().numpy().tobytes())
    return {key: h.hexdigest()[:16] for key, h in hashes.items()}


def update_once(learner, shape: Shape, step: int) -> tuple[dict, float]:
    import torch

    from gspo_mcore.batch.rollout import Batch

    rollouts, advantages = synthetic_rollouts(shape, seed=step)
    if shape.device == "cuda":
        torch.cuda.synchronize()
    began = time.perf_counter()
    learner.scheduler.step(1)
    report = learner.update(Batch(rollouts, advantages, {}), step)
    if shape.device == "cuda":
        torch.cuda.synchronize()
    return report, time.perf_counter() - began


PRECISION_AWARE = ("optimizer.cpu_offload=false", "optimizer.precision_aware=true")


def update_arm(args, shape: Shape, extra=()) -> tuple[object, dict]:
    """A learner of the check's config (+ `extra` overrides) and two updates: the second timed
    (the first allocates the optimizer's states and warms the kernels up). The figures, with
    "pass": finite loss and gradient norm, weights moved, and on CUDA the peak memory within the
    planner's estimate for the same shape (gspo_mcore.planner.cli.ESTIMATE_TOLERANCE)."""
    import torch

    from gspo_mcore.megatron.learner import Learner
    from gspo_mcore.megatron.qwen3_moe.hf_config import parse_hf_config
    from gspo_mcore.planner.cli import ESTIMATE_TOLERANCE, check_layout, flops_per_step, memory_estimate

    config = check_config(args.work, shape, make_inputs(args.work, shape), "bfloat16", extra)
    arch = parse_hf_config(shape.hf)
    free_memory()
    if shape.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    learner = Learner(config)
    before = param_digest(learner.model)
    update_once(learner, shape, step=1)
    report, seconds = update_once(learner, shape, step=2)
    moved = sum(a != b for a, b in zip(before.values(), param_digest(learner.model).values()))
    figures = {"loss": report.get("loss"), "grad_norm": report.get("grad_norm"), "params_moved": moved,
               "params": len(before), "update_s": seconds, "train_tokens_per_s": shape.tokens / seconds}
    # Training FLOPs as the planner counts them (6N per token, attention, full recompute's extra
    # forward): the config's batch is the check's (one group of `sequences`, max_new_tokens = response).
    flops = flops_per_step(config, arch, shape.prompt)["train_tflops"]
    figures["mfu"] = flops / seconds / H100_BF16_TFLOPS if shape.device == "cuda" else None
    planned = memory_estimate(config, arch, check_layout(config, arch, 1, 1), shape.prompt)
    figures.update(planned_gb=planned["trainer_total_gb"], planned_optimizer_gb=planned["trainer_optimizer_gb"])
    finite = all(isinstance(figures[k], float) and math.isfinite(figures[k]) for k in ("loss", "grad_norm"))
    ok = finite and figures["grad_norm"] > 0 and moved > 0
    if shape.device == "cuda":
        figures["peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
        figures["peak_over_planned"] = figures["peak_gb"] / figures["planned_gb"]
        ok = ok and figures["peak_gb"] <= figures["planned_gb"] * ESTIMATE_TOLERANCE
    figures["pass"] = ok
    return learner, figures


def section_3(args, shape) -> dict:
    from gspo_mcore.config import ConfigError
    from gspo_mcore.megatron.qwen3_moe.hf_config import parse_hf_config
    from gspo_mcore.planner.cli import ESTIMATE_TOLERANCE, param_counts

    # Megatron's precision-aware optimizer (bf16 moments on the GPU) first, then freed; then the
    # production optimizer (the config's: offloaded on CUDA), kept for section 4's save.
    try:
        learner, aware = update_arm(args, shape, PRECISION_AWARE)
        del learner
        aware["result"] = "PASS" if aware.pop("pass") else "FAIL"
    except ConfigError as refused:  # on CPU, or without Transformer Engine's FusedAdam (a bare machine)
        aware = {"result": "SKIP", "skip": str(refused)}
    except Exception as err:  # noqa: BLE001 (its verdict; the production arm still runs)
        traceback.print_exc(file=sys.stderr)
        aware = {"result": "FAIL", "error": f"{type(err).__name__}: {str(err)[:300]}"}
    args.learner, figures = update_arm(args, shape)  # section 4 saves this one
    active = param_counts(parse_hf_config(shape.hf))["active"]
    figures.update(tolerance=ESTIMATE_TOLERANCE, active_params_b=active / 1e9)
    figures["precision_aware"] = aware
    if "update_s" in aware:  # side by side: the production arm's step time over the precision-aware one's
        figures["update_s_over_precision_aware"] = figures["update_s"] / aware["update_s"]
        figures["peak_gb_precision_aware"] = aware.get("peak_gb")
    figures["pass"] = figures["pass"] and aware["result"] != "FAIL"
    return figures


def section_4(args, shape) -> dict:
    import subprocess

    from gspo_mcore.megatron.checkpointing import Checkpointer, MegatronState

    learner = getattr(args, "learner", None)
    if learner is None:  # alone (--only 4): the update of section 3 first
        section_3(args, shape)
        learner = args.learner
    out = args.work / f"resume_{shape.device}"
    checkpointer = Checkpointer(out, learner.model)
    checkpointer.register("megatron", MegatronState(learner.ddp, learner.optimizer))
    began = time.perf_counter()
    checkpointer.save(1)
    saved_s = time.perf_counter() - began
    expected = {"params": param_digest(learner.model), "optimizer": optimizer_digest(learner.optimizer)}
    (out / "digest.json").write_text(json.dumps(expected))
    args.learner = None
    del learner, checkpointer
    free_memory()
    child = subprocess.run([sys.executable, __file__, "--resume-from", str(out), "--work", str(args.work),
                            "--device", shape.device, "--wheels", str(args.wheels)],
                           capture_output=True, text=True, timeout=1800, env=fresh_env())
    lines = [line for line in child.stdout.splitlines() if line.startswith("{")]
    if child.returncode != 0 or not lines:
        return {"pass": False, "save_s": saved_s, "error": (child.stderr or child.stdout).strip()[-500:]}
    resumed = json.loads(lines[-1])
    return {**resumed, "save_s": saved_s,
            "pass": resumed["params_equal"] and resumed["optimizer_equal"] and resumed["stepped_again"]}


def fresh_env() -> dict:
    """Our environment without the world of one this process joined (its port is taken)."""
    joined = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    return {k: v for k, v in os.environ.items() if k not in joined}


def resume_child(args, shape) -> int:
    """The fresh process of section 4: the same learner, loaded from the checkpoint; every hash
    compared; one more update."""
    from gspo_mcore.megatron.checkpointing import Checkpointer, MegatronState
    from gspo_mcore.megatron.learner import Learner

    config = check_config(args.work, shape, make_inputs(args.work, shape), "bfloat16")
    learner = Learner(config)
    checkpointer = Checkpointer(args.resume_from, learner.model)
    checkpointer.register("megatron", MegatronState(learner.ddp, learner.optimizer))
    began = time.perf_counter()
    step = checkpointer.load()
    expected = json.loads((args.resume_from / "digest.json").read_text())
    loaded_s = time.perf_counter() - began
    params, states = param_digest(learner.model), optimizer_digest(learner.optimizer)
    report, _ = update_once(learner, shape, step=step + 1)
    print(json.dumps({"resumed_step": step, "load_s": loaded_s, "params_equal": params == expected["params"],
                      "optimizer_states": sorted(states), "optimizer_equal": states == expected["optimizer"],
                      "stepped_again": math.isfinite(report.get("loss", float("nan")))}), flush=True)
    return 0


IPC_READER = r"""
import base64, hashlib, json, pickle, sys
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor
from packed_tensor import unpack_tensor  # vLLM 0.33's, from the wheel folder
# As vLLM's IPC engine maps an export: rebuild_cuda_tensor's arguments pickled by the trainer,
# keyed by this GPU's UUID (ipc_engine.IPCWeightTransferEngine.receive_weights).
for line in sys.stdin:
    info = json.loads(line)
    handles = pickle.loads(base64.b64decode(info["ipc_handles_pickled"]))
    args = list(handles[str(torch.cuda.get_device_properties(0).uuid)])
    args[6] = 0  # the storage's device index, in this process (one visible GPU)
    flat = rebuild_cuda_tensor(*args)
    dtypes = [getattr(torch, d) for d in info["dtype_names"]]
    tensors = unpack_tensor(flat, info["names"], info["shapes"], dtypes, info["tensor_sizes"])
    print(json.dumps({name: hashlib.sha256(t.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()
                      for name, t in tensors}), flush=True)
    del flat, tensors
    torch.cuda.ipc_collect()
"""


def section_5(args, shape) -> dict:
    import hashlib
    import subprocess

    import torch

    from gspo_mcore.engines.vllm.engine import VLLMEngine

    if shape.device != "cuda":
        return {"skip": "CUDA IPC needs a GPU"}
    engine = VLLMEngine(["http://stand-in"])
    engine.prepare_sharing(on_gpu=True)
    reader = subprocess.Popen([sys.executable, "-c", IPC_READER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    equal, g = True, torch.Generator(device="cuda").manual_seed(0)
    for push in range(2):
        bucket = [(f"model.layers.{i}.mlp.experts.{push}.down_proj.weight",
                   torch.randn(2048, 768, device="cuda", generator=g).to(torch.bfloat16)) for i in range(64)]
        flat = engine.pack_bucket(bucket)
        torch.cuda.synchronize()
        payload = engine.shared_payload(flat, [(n, tuple(t.shape)) for n, t in bucket], torch.bfloat16)
        reader.stdin.write(json.dumps(payload) + "\n")
        reader.stdin.flush()
        read = json.loads(reader.stdout.readline())
        equal &= read == {n: hashlib.sha256(t.view(torch.uint8).cpu().numpy().tobytes()).hexdigest() for n, t in bucket}
        del bucket, flat
    reader.stdin.close()
    reader.wait(60)
    torch.cuda.ipc_collect()
    free_memory()
    left = (torch.cuda.memory_allocated() - start) / 2**20
    return {"pushes": 2, "bucket_mb": 64 * 2048 * 768 * 2 / 2**20, "tensors_equal": equal,
            "memory_left_mb": left, "reserved_mb": torch.cuda.memory_reserved() / 2**20,
            "pass": equal and left < 1 and reader.returncode == 0}


def section_6(args, shape) -> dict:
    import threading

    import torch

    from gspo_mcore.engines.vllm import nccl

    if shape.device != "cuda":
        return {"skip": "NCCL needs a GPU"}
    device = torch.cuda.current_device()
    uid, joined = nccl.unique_id(), {}

    def join():
        joined["group"] = nccl.communicator(1, uid, device)
        joined["thread_device"] = torch.cuda.current_device()

    thread = threading.Thread(target=join)
    thread.start()
    thread.join(120)
    group = joined["group"]
    flat = torch.randint(0, 256, (2**30,), device="cuda", dtype=torch.uint8)  # 1 GiB
    head = flat[:4096].clone()
    torch.cuda.synchronize()
    began = time.perf_counter()
    nccl.broadcast(group, flat)
    group.stream.synchronize()
    seconds = time.perf_counter() - began
    intact = bool((flat[:4096] == head).all())  # world of one: the root's data stays
    return {"nccl": ".".join(map(str, nccl.version())), "joined_on_device": joined["thread_device"],
            "rank_device": device, "broadcast_gib": 1.0, "broadcast_s": seconds, "data_intact": intact,
            "pass": joined["thread_device"] == device and intact}


STAND_IN_SERVER = r"""
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
import torch
from transformers import AutoModelForCausalLM
# A stand-in for vLLM 0.33's /v1/completions with prompt_logprobs (its answer's shape:
# entrypoints/openai/completion/protocol.py, vllm/logprobs.py Logprob: logprob, rank >= 1,
# decoded_token; None for the first token), one model per path prefix: /NAME/v1/completions.
device = sys.argv[1]
models = {name: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
          for name, path in (pair.split("=", 1) for pair in sys.argv[2:])}

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):
        name, _, route = self.path.strip("/").partition("/")
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if route != "v1/completions" or name not in models:
            self.send_error(404)
            return
        tokens = body["prompt"]
        with torch.no_grad():
            logits = models[name](input_ids=torch.tensor([tokens], device=device)).logits[0, :-1].float()
        logprobs = torch.log_softmax(logits, -1)
        chosen = logprobs.gather(1, torch.tensor(tokens[1:], device=device)[:, None])[:, 0]
        ranks = (logprobs > chosen[:, None]).sum(-1) + 1
        entries = [None] + [{str(t): {"logprob": lp, "rank": r, "decoded_token": None}}
                            for t, lp, r in zip(tokens[1:], chosen.tolist(), ranks.tolist())]
        data = json.dumps({"choices": [{"index": 0, "text": "", "prompt_logprobs": entries}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


def section_7(args, shape) -> dict:
    """The sync check (gspo_mcore.weight_sync.check_sync) of a push: a learner takes one update at
    a learning rate that moves every weight and writes its weights as the disk push does
    (save_hf_checkpoint); a stand-in server answers from that push and from the checkpoint before
    it (stale). Against the push the median difference is within the config's tolerance; against
    the stale weights it is over 10x that of the push."""
    import subprocess

    from gspo_mcore.megatron.checkpointing import save_hf_checkpoint
    from gspo_mcore.engines.vllm.engine import VLLMEngine
    from gspo_mcore.megatron.learner import Learner
    from gspo_mcore.weight_sync.check import check_sync

    import copy

    hf_dir = make_inputs(args.work, shape)
    if shape.device == "cuda":  # a float32 learner and the server's two float32 models on one GPU: short sequences
        shape = copy.copy(shape)
        shape.sequences, shape.prompt, shape.response = 2, 32, 224
    # float32 on both sides (tolerance 0.01): the push's own noise is rounding, ~1e-5.
    config = check_config(args.work, shape, hf_dir, "float32", ["optimizer.cpu_offload=false", "optimizer.lr=0.01",
                                                                "rollout.engine_dtype=float32"])
    free_memory()
    learner = Learner(config)
    update_once(learner, shape, step=1)
    pushed = save_hf_checkpoint(learner.model, learner.arch, config.model.spec, args.work / f"pushed_{shape.device}",
                                hf_dir)
    server = subprocess.Popen([sys.executable, *(["-S"] if sys.flags.no_site else []), "-c", STAND_IN_SERVER,
                               shape.device, f"pushed={pushed}", f"stale={hf_dir}"], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        port = int(server.stdout.readline())
        rollouts, _ = synthetic_rollouts(shape, seed=7)
        probes = [r.prompt_ids + r.response_ids for r in rollouts[:2]]
        scored_from = [len(r.prompt_ids) for r in rollouts[:2]]
        tolerance = config.sync_check_tolerance
        began = time.perf_counter()
        stats = check_sync(learner.model, VLLMEngine([f"http://127.0.0.1:{port}/pushed"]), probes, tolerance,
                           scored_from)
        check_s = time.perf_counter() - began
        # The stale server's figures (an infinite tolerance: no refusal), to show the margin.
        stale = check_sync(learner.model, VLLMEngine([f"http://127.0.0.1:{port}/stale"]), probes, math.inf, scored_from)
    finally:
        server.kill()
        server.wait(60)
    del learner
    free_memory()
    return {**stats, "tolerance": tolerance, "check_s": check_s, "probe_tokens": [len(p) for p in probes],
            "stale_median": stale["sync_check_median"], "stale_within_0.1": stale["sync_check_within_0.1"],
            "stale_over_pushed": stale["sync_check_median"] / max(stats["sync_check_median"], 1e-12),
            # Within the tolerance against the push, and the stale weights 10x further: a random
            # model's log-probs are nearly flat (a trained one's stale differences reach ~1).
            "pass": stats["sync_check_median"] <= tolerance
                    and stale["sync_check_median"] > 10 * stats["sync_check_median"]}


# ---------------------------------------------------------------- main

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python launch/gpu_check.py", description=__doc__.splitlines()[0])
    parser.add_argument("--wheels", type=Path, default=WHEELS, help="launch/wheelhouse.sh's folder (default %(default)s)")
    parser.add_argument("--work", type=Path, default=Path("runs/gpu_check"), help="the synthetic checkpoint and the "
                        "save of section 4 (~8 GB on CUDA; default %(default)s)")
    parser.add_argument("--only", type=int, action="append", choices=sorted(SECTIONS), help="run this section only")
    parser.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when torch sees one")
    parser.add_argument("--resume-from", type=Path, help=argparse.SUPPRESS)  # section 4's fresh process
    args = parser.parse_args(argv)
    wheels = use_wheels(args.wheels)
    sys.path.insert(0, str(REPO))
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda: torch sees no CUDA device", file=sys.stderr)
        return 2
    bridge_missing_transformer_engine()
    args.work = args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    shape = Shape(args.device)
    if args.resume_from:
        return resume_child(args, shape)
    failed = False
    for number in args.only or sorted(SECTIONS):
        began = time.perf_counter()
        try:
            figures = globals()[f"section_{number}"](args, shape)
        except Exception as err:  # noqa: BLE001 (a section's failure is its verdict; the next one runs)
            traceback.print_exc(file=sys.stderr)
            figures = {"pass": False, "error": f"{type(err).__name__}: {str(err)[:300]}"}
        result = "SKIP" if "skip" in figures else ("PASS" if figures.pop("pass") else "FAIL")
        failed |= result == "FAIL"
        line = {"section": number, "name": SECTIONS[number], "result": result, "device": shape.device,
                "seconds": round(time.perf_counter() - began, 2), **figures}
        if number == 1:
            line["wheel_paths"] = len(wheels)
        print(json.dumps(line, default=str), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
