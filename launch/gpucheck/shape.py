"""What the sections build on: the model and batch of one device (Shape), the synthetic checkpoint,
the check's config, its batch, one timed update and the hashes a resume compares. Imported by the
child processes; nothing here runs at import."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
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

    @property
    def lengths(self) -> list[int]:
        """Each sequence's tokens: what attention's FLOPs grow with (gspo_mcore.planner.flops)."""
        return [self.prompt + self.response] * self.sequences


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


CONFIG = REPO / "configs/qwen3_30b_a3b_gspo.yaml"


def check_overrides(work: Path, shape: Shape, hf_dir: Path, dtype: str, extra=()) -> list[str]:
    """configs/qwen3_30b_a3b_gspo.yaml on this one device: the synthetic model, `spec: local`
    (Transformer Engine is not on a bare machine), EP 1, one minibatch of the check's batch."""
    overrides = [f"model.hf_dir={hf_dir}", "model.mcore_dir=null", "model.spec=local", f"model.dtype={dtype}",
                 f"distributed.device={shape.device}", "distributed.expert_parallel=1",
                 f"data.path={work / 'prompts.jsonl'}", f"data.tokenizer_dir={hf_dir}", "eval.datasets=[]",
                 "train.num_minibatches=1", "train.rollout_batch_size=1", f"train.group_size={shape.sequences}",
                 f"train.max_tokens_per_microbatch={shape.tokens}", f"rollout.max_new_tokens={shape.response}",
                 "weight_sync.method=disk", "rollout.num_servers=1", "rollout.engine_tp=1",
                 # The arms name their optimizer against offloaded Adam (updates.ARMS), not the
                 # config's precision-aware default (Transformer Engine, absent on a bare machine).
                 "optimizer.precision_aware=false", "optimizer.cpu_offload=true", "optimizer.offload_grad_buffers=false"]
    if shape.device == "cpu":
        overrides.append("optimizer.cpu_offload=false")  # Megatron's HybridDeviceOptimizer is CUDA only
    return [*overrides, *extra]


def check_config(work: Path, shape: Shape, hf_dir: Path, dtype: str, extra=()):
    """The check's config (check_overrides), loaded."""
    from gspo_mcore.config import load_config

    return load_config(CONFIG, check_overrides(work, shape, hf_dir, dtype, extra))


def free_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


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


def tensor_bytes(tensor):
    """A tensor's raw bytes on the host (bitwise: a hash of them is equal only for equal values),
    without a float32 copy."""
    import torch

    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()


def param_digest(model) -> dict[str, str]:
    import hashlib

    return {name: hashlib.sha256(tensor_bytes(p)).hexdigest()[:16] for name, p in model.named_parameters()}


def optimizer_digest(optimizer) -> dict[str, str]:
    """Per kind of optimizer state (the main weights, each Adam state), one hash over every
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
                        hashes.setdefault(key, hashlib.sha256()).update(tensor_bytes(value))
    return {key: h.hexdigest()[:16] for key, h in hashes.items()}


def update_once(learner, shape: Shape, step: int) -> tuple[dict, float]:
    """One GSPO update of the check's batch (seeded by `step`); its report and seconds (CUDA: to
    the last kernel)."""
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
