"""Several checks in one torchrun launch: `torchrun ... tests/workers/jobs.py SPEC.json`.

A launch costs ~9 s of imports on the 2-core CI machine, so the tests plan every job of a
parallel layout up front (conftest.layout_output) and run them here in one go. Each job
rebuilds the model from its own config (init_distributed re-creates the parallel state) and
writes its results under its `out_dir`. SPEC.json is a list of jobs:

    {"kind": "parity" | "train_step" | "export_owned" | "save_hf",
     "hf_dir": ..., "out_dir": ..., "overrides": ["key=value", ...], "batch_file": (train_step)}
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from gspo_mcore import parity
from gspo_mcore.config import load_config
from gspo_mcore.megatron_loss import global_normalizer, make_loss_func
from gspo_mcore.models.qwen3_moe.bootstrap import model_from_config
from gspo_mcore.models.qwen3_moe.hf_config import load_hf_config
from gspo_mcore.models.qwen3_moe.parallel_weights import export_hf_weights, owned_hf_weights
from gspo_mcore.optimizer import setup_training
from gspo_mcore.weight_sync import bucketed, save_hf_checkpoint

MICRO_BATCH = 2
BUCKET_BYTES = 100_000  # export_owned's bucket bound (tests/test_weight_export.py checks it)


def parity_job(config, out_dir: Path, job: dict) -> None:
    """Logits vs transformers and the exported weights vs the file (gspo_mcore.parity.run):
    rank 0 writes figures.json."""
    vocab_size = load_hf_config(config.model.hf_dir).vocab_size
    figures = parity.run(config, parity.sample_tokens(vocab_size, job.get("batch", 4), job.get("seq_len", 16)))
    if figures is not None:
        (out_dir / "figures.json").write_text(json.dumps(figures))


def train_step_job(config, out_dir: Path, job: dict) -> None:
    """One training step on the global batch in `batch_file`: `tokens` [B, T + 1]; with
    `advantages`, `old_logprobs` and `mask` too, the loss is GSPO (config section `loss`)
    through gspo_mcore.megatron_loss, else token cross-entropy. Each rank saves to
    rank{R}.pt the HF-named weights it holds after the step, the grad norm and the global
    loss, for comparison with the same step taken by the Hugging Face model."""
    arch, model = model_from_config(config)
    ddp, optimizer = setup_training(model, config.optimizer)
    batch = torch.load(job["batch_file"])
    dp_size, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    local = {key: value.chunk(dp_size)[dp_rank] for key, value in batch.items()}
    microbatches = [{key: value[i : i + MICRO_BATCH] for key, value in local.items()}
                    for i in range(0, len(local["tokens"]), MICRO_BATCH)]
    gspo = "advantages" in batch
    normalizer = global_normalizer([mb["mask"] for mb in microbatches]) if gspo else None

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        inputs, targets = mb["tokens"][:, :-1], mb["tokens"][:, 1:]
        if gspo:
            logits = model(inputs, parity.position_ids_for(inputs), None)
            return logits, make_loss_func({**mb, "targets": targets}, normalizer, config.loss, len(microbatches))
        token_losses = model(inputs, parity.position_ids_for(inputs), None, labels=targets)

        def loss_func(token_losses):
            # Mean over the microbatch: the schedule's 1/num_microbatches and DDP's DP average
            # make it the global mean (equal-size microbatches).
            loss = token_losses.float().mean()
            return loss, {"loss": loss.detach().clone() / (len(microbatches) * dp_size)}

        return token_losses, loss_func

    ddp.train()
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    outputs = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(microbatches), model=[ddp],
        num_microbatches=len(microbatches), seq_length=batch["tokens"].shape[1] - 1, micro_batch_size=MICRO_BATCH,
        forward_only=False,
    )
    update_ok, grad_norm, _ = optimizer.step()
    loss = None
    if parallel_state.is_pipeline_last_stage():
        # Each microbatch reports its share of the global loss.
        loss = torch.stack([out["loss"] for out in outputs]).sum()
        dist.all_reduce(loss, group=parallel_state.get_data_parallel_group())
        loss = loss.item()
    weights = {name: t.clone() for name, t in export_hf_weights(model, arch, config.model.spec)}
    torch.save({"update_ok": bool(update_ok), "grad_norm": float(grad_norm), "loss": loss, "weights": weights},
               out_dir / f"rank{dist.get_rank()}.pt")


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


JOBS = {"parity": parity_job, "train_step": train_step_job, "export_owned": export_owned_job,
        "save_hf": save_hf_job}


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
