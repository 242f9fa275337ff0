"""One training step under a parallel layout, on a global batch saved by the test.

The batch file holds `tokens` [B, T + 1]; with `advantages`, `old_logprobs` and `mask` too,
the loss is GSPO (config section `loss`) through gspo_mcore.megatron_loss, else token
cross-entropy. Run under torchrun by the tests. Each rank saves, to OUT_DIR/rank{R}.pt,
the HF-named weights it holds after the step, the grad norm and the global loss, so the
test can compare them with the same step taken by the Hugging Face model.
"""

import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from gspo_mcore.config import load_config
from gspo_mcore.megatron_loss import global_normalizer, make_loss_func
from gspo_mcore.models.qwen3_moe.bootstrap import model_from_config
from gspo_mcore.models.qwen3_moe.parallel_weights import export_hf_weights
from gspo_mcore.optimizer import setup_training
from gspo_mcore.parity import position_ids_for

MICRO_BATCH = 2


def main(hf_dir: str, tokens_file: str, out_dir: str, overrides: list[str]) -> None:
    config = load_config(None, [f"model.hf_dir={hf_dir}", *overrides])
    arch, model = model_from_config(config)
    ddp, optimizer = setup_training(model, config.optimizer)

    batch = torch.load(tokens_file)  # the global batch
    dp_size, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    local = {key: value.chunk(dp_size)[dp_rank] for key, value in batch.items()}
    microbatches = [
        {key: value[i : i + MICRO_BATCH] for key, value in local.items()}
        for i in range(0, len(local["tokens"]), MICRO_BATCH)
    ]
    gspo = "advantages" in batch
    normalizer = global_normalizer([mb["mask"] for mb in microbatches]) if gspo else None

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        inputs, targets = mb["tokens"][:, :-1], mb["tokens"][:, 1:]
        if gspo:
            logits = model(inputs, position_ids_for(inputs), None)
            return logits, make_loss_func({**mb, "targets": targets}, normalizer, config.loss, len(microbatches))
        token_losses = model(inputs, position_ids_for(inputs), None, labels=targets)

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
        forward_step_func=forward_step,
        data_iterator=iter(microbatches),
        model=[ddp],
        num_microbatches=len(microbatches),
        seq_length=batch["tokens"].shape[1] - 1,
        micro_batch_size=MICRO_BATCH,
        forward_only=False,
    )
    update_ok, grad_norm, _ = optimizer.step()
    loss = None
    if parallel_state.is_pipeline_last_stage():
        # Each microbatch reports its share of the global loss.
        loss = torch.stack([out["loss"] for out in outputs]).sum()
        dist.all_reduce(loss, group=parallel_state.get_data_parallel_group())
        loss = loss.item()
    torch.save(
        {
            "update_ok": bool(update_ok),
            "grad_norm": float(grad_norm),
            "loss": loss,
            "weights": {name: t.clone() for name, t in export_hf_weights(model, arch, config.model.spec)},
        },
        f"{out_dir}/rank{dist.get_rank()}.pt",
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])
