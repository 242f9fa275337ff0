"""Several checks in one torchrun launch: `torchrun ... tests/workers/jobs.py SPEC.json`.

A launch costs ~9 s of imports on the 2-core CI machine, so the tests plan every job of a
parallel layout up front (conftest.layout_output) and run them here in one go. Each job
rebuilds the model from its own config (init_distributed re-creates the parallel state) and
writes its results under its `out_dir`. SPEC.json is a list of jobs:

    {"kind": "parity" | "parity_converted" | "train_step" | "export_owned" | "save_hf" | "save_mcore",
     "hf_dir": ..., "out_dir": ..., "overrides": ["key=value", ...], "batch_file": (train_step)}
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state

from checkpoint_convert import convert

from gspo_mcore.megatron import parity
from gspo_mcore.config import load_config
from gspo_mcore.megatron.learner import Learner
from gspo_mcore.gspo.logprobs import token_logprobs
from gspo_mcore.megatron.qwen3_moe.bootstrap import join_process_groups, model_from_config
from gspo_mcore.megatron.qwen3_moe.hf_config import load_hf_config
from gspo_mcore.megatron.qwen3_moe.parallel_weights import export_hf_weights, owned_hf_weights
from gspo_mcore.megatron.optimizer import optimizer_step, setup_training
from gspo_mcore.batch.rollout import Batch, Rollout
from gspo_mcore.megatron.checkpointing import save_hf_checkpoint
from gspo_mcore.weight_sync import bucketed

MICRO_BATCH = 2
BUCKET_BYTES = 100_000  # export_owned's bucket bound (tests/test_weight_export.py checks it)


def parity_job(config, out_dir: Path, job: dict, mcore_dir: str | None = None) -> None:
    """Logits vs transformers and the exported weights vs the file (gspo_mcore.megatron.parity.run),
    the model loaded from the HF weights or the torch_dist checkpoint `mcore_dir`: rank 0 writes
    figures.json."""
    vocab_size = load_hf_config(config.model.hf_dir).vocab_size
    figures = parity.run(config, parity.sample_tokens(vocab_size, job.get("batch", 4), job.get("seq_len", 16)),
                         mcore_dir)
    if figures is not None:
        (out_dir / "figures.json").write_text(json.dumps(figures))


def parity_converted_job(config, out_dir: Path, job: dict) -> None:
    """parity_job on the converter's torch_dist output (checkpoint_convert.convert.hf_to_mcore, run
    by rank 0 into out_dir/mcore) loaded under this layout instead of the HF weights."""
    join_process_groups(config)
    mcore = out_dir / "mcore"
    if dist.get_rank() == 0:
        convert.hf_to_mcore(config.model.hf_dir, mcore, quiet=True)
    dist.barrier()
    parity_job(config, out_dir, job, str(mcore))


def save_mcore_job(config, out_dir: Path, job: dict) -> None:
    """The model (from the HF weights) saved by Megatron's own dist_checkpointing under this layout,
    as the trainer saves: out_dir/saved/iter_0000001 and latest_checkpointed_iteration.txt."""
    _, model = model_from_config(config)
    iteration_dir = out_dir / "saved" / "iter_0000001"
    if dist.get_rank() == 0:
        iteration_dir.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), str(iteration_dir))
    if dist.get_rank() == 0:
        (out_dir / "saved" / "latest_checkpointed_iteration.txt").write_text("1")


def train_step_job(config, out_dir: Path, job: dict) -> None:
    """One training step on the global batch in `batch_file`, by the trainer's own code. With
    `advantages` in the batch it is a GSPO update of gspo_mcore.megatron.learner.Learner (config sections
    `loss` and `train`: packing, equal microbatch counts over DP ranks, the reference model, the
    exact global normalisation); without, token cross-entropy through the same schedule
    (gspo_mcore.megatron.qwen3_moe.forward.run_schedule). Each rank saves to rank{R}.pt the HF-named
    weights it holds after the step, the grad norm and the global loss, for comparison with the
    same step taken by the Hugging Face model."""
    batch = torch.load(job["batch_file"])
    if "advantages" in batch:
        learner = Learner(config)
        metrics = learner.update(Batch(rollouts_of(batch), batch["advantages"].tolist(), {}), step=0)
        result = {"grad_norm": metrics["grad_norm"], "loss": metrics["loss"], "metrics": metrics}
        model, arch = learner.model, learner.arch
    else:
        arch, model = model_from_config(config)
        result = cross_entropy_step(model, config, batch["tokens"])
    weights = {name: t.clone() for name, t in export_hf_weights(model, arch, config.model.spec)}
    torch.save({**result, "weights": weights}, out_dir / f"rank{dist.get_rank()}.pt")


def rollouts_of(batch: dict) -> list[Rollout]:
    """The batch's sequences as engine rollouts: prompt, response, the engine's log-probs."""
    rollouts = []
    loss_masks = batch.get("loss_mask") or [()] * len(batch["tokens"])  # multi-turn: environment tokens 0
    for tokens, old, p, r, loss_mask in zip(batch["tokens"].tolist(), batch["old_logprobs"].tolist(),
                                            batch["prompt_lengths"].tolist(), batch["response_lengths"].tolist(),
                                            loss_masks):
        rollouts.append(Rollout(tokens[:p], tokens[p:p + r], old[p - 1:p - 1 + r], "stop", "v0",
                                loss_mask=tuple(loss_mask)))
    return rollouts


def cross_entropy_step(model, config, tokens: torch.Tensor) -> dict:
    ddp, optimizer = setup_training(model, config.optimizer)
    dp_size, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    local = tokens.chunk(dp_size)[dp_rank]
    microbatches = [{"inputs": t[:, :-1], "targets": t[:, 1:]} for t in local.split(MICRO_BATCH)]

    def loss_for(mb):
        def loss_func(logits):
            logprobs, _ = token_logprobs(logits, mb["targets"], group=parallel_state.get_tensor_model_parallel_group())
            # Mean over the microbatch: the schedule's 1/num_microbatches and DDP's DP average
            # make it the global mean (equal-size microbatches).
            loss = -logprobs.mean()
            return loss, {"loss": loss.detach().clone() / (len(microbatches) * dp_size)}
        return loss_func

    ddp.train()
    outputs, grad_norm = optimizer_step(ddp, optimizer, microbatches, loss_for,
                                        fused_logprobs=config.model.fused_logprobs)
    loss = None
    if parallel_state.is_pipeline_last_stage():
        # Each microbatch reports its share of the global loss.
        loss = torch.stack([out["loss"] for out in outputs]).sum()
        dist.all_reduce(loss, group=parallel_state.get_data_parallel_group())
        loss = loss.item()
    return {"grad_norm": float(grad_norm), "loss": loss}


def export_owned_job(config, out_dir: Path, job: dict) -> None:
    """Each tensor on its one owner rank, in buckets: each rank saves what it got to rank{R}.pt."""
    arch, model = model_from_config(config)
    buckets = [[(name, t.clone()) for name, t in bucket]
               for bucket in bucketed(owned_hf_weights(model, arch, config.model.spec), BUCKET_BYTES)]
    torch.save(buckets, out_dir / f"rank{dist.get_rank()}.pt")


def save_hf_job(config, out_dir: Path, job: dict) -> None:
    """Load the HF checkpoint into the sharded model and write it back to out_dir/hf."""
    arch, model = model_from_config(config)
    save_hf_checkpoint(model, arch, config.model.spec, out_dir / "hf", config.model.hf_dir)


def routing_delivery_job(config, out_dir: Path, job: dict) -> None:
    """Rank 0 holds every rollout's routed experts (rows of `lengths` tokens, 4 layers, top-2,
    each entry (rollout, token, layer, k) coded as a uint8 the test recomputes; `lengths` and
    `step` in batch_file); the
    trainer's delivery (gspo_mcore.megatron.routing_delivery) gives each rank what its update reads. Each
    rank saves what it got, the rollouts its update reads and its MoE layers to rank{R}.pt."""
    import numpy as np

    from gspo_mcore.megatron.routing_delivery import deliver_routing, take_routing

    spec = torch.load(job["batch_file"])
    learner = Learner(config)
    rollouts = []
    for i, n in enumerate(spec["lengths"]):
        codes = (np.arange(n * 4 * 2).reshape(n, 4, 2) + 7 * i) % 251
        rollouts.append(Rollout([1] * 2, [2] * (n - 1), [-0.5] * (n - 1), "stop", "v0",
                                routed_experts=codes.astype(np.uint8)))
    batch = Batch(rollouts, [1.0] * len(rollouts), {})
    batch, routing = take_routing(batch)
    if dist.get_rank() != 0:
        routing = None
    assert all(r.routed_experts is None for r in batch.rollouts)
    minibatches = learner.minibatch_split(len(rollouts), spec["step"])
    wanted = learner.routing_wanted(batch.rollouts, minibatches, recompute=False)
    largest = deliver_routing(batch, routing, wanted, learner.routers.layers)
    got = {i: torch.from_numpy(r.routed_experts) for i, r in enumerate(batch.rollouts) if r.routed_experts is not None}
    reads = sorted({i for mini in minibatches
                    for mb in learner.microbatches(mini, batch.rollouts, [0.0] * len(rollouts))
                    for i in mb["index"].tolist() if i >= 0})
    torch.save({"got": got, "reads": reads, "layers": learner.routers.layers, "largest_mb": largest},
               out_dir / f"rank{dist.get_rank()}.pt")


JOBS = {"routing_delivery": routing_delivery_job, "parity": parity_job, "parity_converted": parity_converted_job,
        "train_step": train_step_job, "export_owned": export_owned_job, "save_hf": save_hf_job,
        "save_mcore": save_mcore_job}


def main(spec_file: str) -> None:
    for job in json.loads(Path(spec_file).read_text()):
        config = load_config(None, [f"model.hf_dir={job['hf_dir']}", *job["overrides"]])
        out_dir = Path(job["out_dir"])
        out_dir.mkdir(parents=True, exist_ok=True)
        JOBS[job["kind"]](config, out_dir, job)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
