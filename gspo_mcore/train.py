"""The GSPO trainer: rollout -> reward -> GSPO update on Megatron -> weight sync, per step.

    gspo-train --config FILE [--output-dir DIR] [--resume] [key=value ...]
    python -m gspo_mcore.train ...   (plain python for one process, or under torchrun)

Each step:
1. rank 0 asks the engine for `group_size` responses to each of `rollout_batch_size`
   prompts; the engine returns token ids and per-token log-probs (GSPO's pi_old);
2. rewards, group-normalised advantages, groups without signal dropped (dynamic sampling,
   with more rounds of generation until the batch is full, up to `max_sampling_rounds`);
3. the batch is split into `num_minibatches`, each balanced across data-parallel ranks and
   packed into microbatches by a token budget; one optimizer step per minibatch with the GSPO
   loss against the engine's log-probs: no old-policy forward, no routing replay;
4. the new weights are pushed to the engine, tagged with the next weight version.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from gspo_mcore import advantages as adv
from gspo_mcore.config import Config, load_config
from gspo_mcore.errors import InputError, run_cli
from gspo_mcore.megatron_loss import global_normalizer, make_loss_func
from gspo_mcore.models.qwen3_moe.model import DTYPES
from gspo_mcore.packing import balance_across_ranks, pack_microbatches, split_minibatches
from gspo_mcore.parallel import device, to_device
from gspo_mcore.parity import position_ids_for
from gspo_mcore.rollout.response import Rollout, collate

def start_servers(config: Config, output_dir: Path, stack: ExitStack) -> list[str]:
    """The CPU default / tests: SGLang servers for model.hf_dir that the run owns (rank 0)."""
    from gspo_mcore.parallel import free_port
    from gspo_mcore.rollout.server import ManagedServer, server_for_config

    urls = []
    for index in range(config.rollout.num_servers):
        port = free_port()
        cmd, env = server_for_config(config, port)
        url = f"http://127.0.0.1:{port}"
        stack.enter_context(ManagedServer(cmd, url, output_dir / "logs" / f"sglang_{index}.log", env=env))
        urls.append(url)
    return urls


# ---------------------------------------------------------------- rollouts (rank 0)


class RolloutSource:
    """Prompts -> engine rollouts -> rewards -> advantages, on rank 0."""

    def __init__(self, config: Config):
        """Loads the tokenizer, the dataset and the reward (bad input fails here, before any
        server starts); `connect` then names the servers."""
        from transformers import AutoTokenizer

        from gspo_mcore.data import PromptDataset, PromptSampler
        from gspo_mcore.rewards.runner import RewardRunner

        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(config.data.tokenizer_dir or config.model.hf_dir)
        if not config.data.path:
            raise InputError("data.path: no prompt dataset given")
        self.dataset = PromptDataset.load(config.data.path, config.data.prompt_key, config.data.messages_key,
                                          config.data.answer_key)
        self.sampler = PromptSampler(len(self.dataset), seed=config.train.seed)
        self.rewards = RewardRunner(config.reward.name, config.reward.timeout_s, config.reward.workers)
        self.running = adv.RunningMoments()
        self.client = None

    def connect(self, urls: list[str], vocab_size: int) -> None:
        from gspo_mcore.rollout.client import SGLangClient

        self.client = SGLangClient(urls, vocab_size, request_timeout_s=self.config.rollout.request_timeout_s,
                                   max_attempts=self.config.rollout.max_attempts)

    def collect(self, step: int, weight_version: str) -> tuple[list[Rollout], list[float], dict]:
        """Rounds of generation until `rollout_batch_size` groups with signal are kept (at most
        `max_sampling_rounds`; each asks for `oversample` x the groups still missing). Metrics
        are over everything generated this step."""
        cfg = self.config.train
        rollouts, advantages, rounds = [], [], []
        for _ in range(cfg.max_sampling_rounds):
            missing = cfg.rollout_batch_size - sum(r["groups_kept"] for r in rounds)
            if missing <= 0:
                break
            kept, kept_advantages, figures = self._round(step, weight_version, missing,
                                                         offset=sum(r["requests"] for r in rounds))
            rollouts += kept
            advantages += kept_advantages
            rounds.append(figures)
        rewards = torch.cat([r["rewards"] for r in rounds])
        lengths = torch.cat([r["lengths"] for r in rounds])
        metrics = {
            "reward_mean": rewards.mean().item(),
            "reward_std": rewards.std(unbiased=False).item(),
            "response_length_mean": lengths.mean().item(),
            "response_length_max": lengths.max().item(),
            "truncated_fraction": sum(r["truncated"] for r in rounds) / len(lengths),
            "groups_kept": sum(r["groups_kept"] for r in rounds),
            "groups_total": sum(r["groups_total"] for r in rounds),
            "sampling_rounds": len(rounds),
            "reward_errors": sum(r["reward_errors"] for r in rounds),
            "reward_timeouts": sum(r["reward_timeouts"] for r in rounds),
        }
        return rollouts, advantages, metrics

    def _round(self, step: int, weight_version: str, wanted: int, offset: int) -> tuple[list, list, dict]:
        """One generation round: `wanted` x oversample prompts; keeps at most `wanted` groups.
        `offset`: requests already made this step (their seeds are taken)."""
        from gspo_mcore.data import chat_prompt_ids

        cfg = self.config.train
        num_prompts = math.ceil(wanted * cfg.oversample)
        samples = [self.dataset[i] for i in self.sampler.next_indices(num_prompts)]
        prompts = [chat_prompt_ids(self.tokenizer, s.messages) for s in samples]
        requests = [p for p in prompts for _ in range(cfg.group_size)]
        params = {"max_new_tokens": self.config.rollout.max_new_tokens, "temperature": self.config.loss.temperature}
        # Seeds from (run seed, step, request): with a deterministic server, a resumed run
        # samples what the uninterrupted one did.
        base = (cfg.seed * 1_000_003 + step) * 100_003 + offset
        seeds = [base + i for i in range(len(requests))]
        rollouts = self.client.generate(requests, params, weight_version=weight_version, seeds=seeds)
        texts = self.tokenizer.batch_decode([r.response_ids for r in rollouts], skip_special_tokens=True)
        answers = [s.answer for s in samples for _ in range(cfg.group_size)]
        scores, stats = self.rewards.score(texts, answers)
        rewards = torch.tensor(scores, dtype=torch.float32)
        group_ids = torch.arange(len(samples)).repeat_interleave(cfg.group_size)
        # reward_norm "batch" / "running": over this round's rewards / updated by each round.
        normed = adv.normalize_rewards(rewards, group_ids, cfg.reward_norm, self.running)
        advantages = adv.clip(adv.group_advantages(normed, group_ids, normalize_std=cfg.advantage_std_norm),
                              cfg.advantage_clip)
        keep = adv.informative_groups(rewards, group_ids) if cfg.drop_zero_std_groups else torch.ones_like(rewards, dtype=torch.bool)
        kept_groups = set(sorted(set(group_ids[keep].tolist()))[:wanted])  # the first ones with signal
        selected = [i for i, g in enumerate(group_ids.tolist()) if g in kept_groups]
        figures = {
            "rewards": rewards, "lengths": torch.tensor([len(r.response_ids) for r in rollouts], dtype=torch.float32),
            "truncated": sum(r.truncated for r in rollouts), "groups_kept": len(kept_groups),
            "groups_total": len(samples), "requests": len(requests),
            "reward_errors": stats.errors, "reward_timeouts": stats.timeouts,
        }
        return [rollouts[i] for i in selected], [advantages[i].item() for i in selected], figures

    def state_dict(self) -> dict:
        return {"sampler": self.sampler.state_dict(), "running": self.running.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])
        self.running.load_state_dict(state["running"])

    def close(self) -> None:
        self.rewards.close()


# ---------------------------------------------------------------- the update (all ranks)


class RouterLoad:
    """Tokens per expert per layer, counted by hooks on the routers during training forwards."""

    def __init__(self, model, num_layers: int, num_experts: int):
        # On device(): a per-layer .cpu() in the hook would synchronise the GPU every forward.
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.float64, device=device())
        for layer in model.decoder.layers:
            router = getattr(getattr(layer, "mlp", None), "router", None)
            if router is not None:
                router.register_forward_hook(self._hook(layer.layer_number - 1))

    def _hook(self, index: int):
        def hook(module, inputs, output):
            if module.training:
                routing_map = output[1]  # [tokens, experts] bool
                self.counts[index] += routing_map.detach().sum(0).double()
        return hook

    def reset(self) -> None:
        self.counts.zero_()

    def imbalance(self) -> list[float]:
        """Per MoE layer, max expert load / mean load over all ranks' tokens (1 = balanced)."""
        counts = self.counts.clone()
        dist.all_reduce(counts)
        return [(row.max() / row.mean()).item() for row in counts if row.sum() > 0]


def _microbatch(rollouts: list[Rollout], advantages: list[float], members: list[int]) -> dict:
    batch = collate([rollouts[i] for i in members])
    tokens = batch.pop("tokens")
    # Sequence parallel splits the sequence over the TP ranks: pad it to a multiple of TP
    # (right padding, masked out, does not change a causal model's outputs before it).
    tp = parallel_state.get_tensor_model_parallel_world_size()
    extra = -(tokens.shape[1] - 1) % tp
    if extra:
        tokens = torch.nn.functional.pad(tokens, (0, extra))
        batch = {k: torch.nn.functional.pad(v, (0, extra)) for k, v in batch.items()}
    return {**batch, "inputs": tokens[:, :-1], "targets": tokens[:, 1:],
            "advantages": torch.tensor([advantages[i] for i in members]), "index": torch.tensor(members)}


def _run_schedule(ddp, microbatches: list[dict], loss_for, forward_only: bool) -> list[dict]:
    data = iter(microbatches)

    def forward_step(data_iterator, model):
        mb = to_device(next(data_iterator))
        output = model(mb["inputs"], position_ids_for(mb["inputs"]), None)
        return output, loss_for(mb)

    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=data, model=[ddp], num_microbatches=len(microbatches),
        seq_length=max(mb["inputs"].shape[1] for mb in microbatches),
        micro_batch_size=max(mb["inputs"].shape[0] for mb in microbatches), forward_only=forward_only,
    )


def _my_microbatches(indices, rollouts, advantages, budget) -> list[dict]:
    lengths = [len(r.prompt_ids) + len(r.response_ids) - 1 for r in rollouts]
    shards = balance_across_ranks(indices, lengths, parallel_state.get_data_parallel_world_size())
    mine = shards[parallel_state.get_data_parallel_rank()]
    return [_microbatch(rollouts, advantages, m) for m in pack_microbatches(mine, lengths, budget)]


def _gather_dp(values: list) -> list:
    out = [None] * parallel_state.get_data_parallel_world_size()
    dist.all_gather_object(out, values, group=parallel_state.get_data_parallel_group())
    return [v for part in out for v in part]


@torch.no_grad()
def recompute_logprobs(ddp, rollouts, advantages, config: Config) -> None:
    """Optional (comparison runs): replace the engine's log-probs with a trainer forward."""
    from gspo_mcore.logprobs import token_logprobs

    ddp.eval()
    microbatches = _my_microbatches(list(range(len(rollouts))), rollouts, advantages,
                                    config.train.max_tokens_per_microbatch)

    def loss_for(mb):
        def loss_func(logits):
            lp, _ = token_logprobs(logits, mb["targets"], temperature=config.loss.temperature,
                                   group=parallel_state.get_tensor_model_parallel_group())
            return logits.new_zeros(()), {"index": mb["index"], "logprobs": lp.float(), "mask": mb["mask"]}
        return loss_func

    outputs = _run_schedule(ddp, microbatches, loss_for, forward_only=True)
    found = []
    if parallel_state.is_pipeline_last_stage():
        for out in outputs:
            logprobs, mask = out["logprobs"].cpu(), out["mask"].cpu().bool()  # one copy, not one per row
            for row, i in enumerate(out["index"].tolist()):
                found.append((i, logprobs[row][mask[row]].tolist()))
    # Every stage needs them (the loss runs on the last stage, but keep ranks consistent);
    # only the last stage found any, the broadcast below hands them to the others.
    last = [_gather_dp(found)]
    src = parallel_state.get_pipeline_model_parallel_last_rank()
    dist.broadcast_object_list(last, src=src, group=parallel_state.get_pipeline_model_parallel_group())
    for i, values in last[0]:
        r = rollouts[i]
        rollouts[i] = Rollout(r.prompt_ids, r.response_ids, values, r.finish_reason, r.weight_version)


def train_on_batch(ddp, optimizer, rollouts, advantages, config: Config, step: int) -> dict:
    """`num_minibatches` optimizer steps (x ppo_epochs) on one rollout batch; metrics on every rank."""
    cfg = config.train
    dp = parallel_state.get_data_parallel_world_size()
    num_minibatches = min(cfg.num_minibatches, len(rollouts) // dp)
    if num_minibatches == 0:
        return {}
    generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    order = torch.randperm(len(rollouts), generator=generator).tolist()
    ddp.train()
    per_seq, grad_norms, losses = [], [], []
    for epoch in range(cfg.ppo_epochs):
        for number, mini in enumerate(split_minibatches(len(rollouts), num_minibatches)):
            microbatches = _my_microbatches([order[i] for i in mini], rollouts, advantages,
                                            cfg.max_tokens_per_microbatch)
            normalizer = global_normalizer([mb["mask"] for mb in microbatches])

            def loss_for(mb):
                return make_loss_func(mb, normalizer, config.loss, len(microbatches))

            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            outputs = _run_schedule(ddp, microbatches, loss_for, forward_only=False)
            ok, grad_norm, _ = optimizer.step()
            grad_norms.append(float(grad_norm) if grad_norm is not None else float("nan"))
            if parallel_state.is_pipeline_last_stage():
                tag = (epoch, number)
                # Each microbatch's outputs in schedule order, so its advantages come from it.
                per_seq += [(tag, lr, a) for out, mb in zip(outputs, microbatches) for lr, a in
                            zip(out["seq_log_ratio"].tolist(), mb["advantages"].tolist())]
                losses.append(sum(out["loss"].item() for out in outputs))
    metrics = [None]
    last = dist.get_world_size() - 1
    if parallel_state.is_pipeline_last_stage():
        per_seq = _gather_dp(per_seq)
        loss_total = torch.tensor(losses, dtype=torch.float64, device=device())
        dist.all_reduce(loss_total, group=parallel_state.get_data_parallel_group())
        if dist.get_rank() == last:
            metrics = [_update_metrics(per_seq, loss_total.tolist(), grad_norms, config)]
    dist.broadcast_object_list(metrics, src=last)
    return {**metrics[0], "minibatches": num_minibatches, "lr": optimizer.param_groups[0]["lr"]}


# A step whose groups all lacked signal (or too few for the data-parallel ranks) trains on
# nothing: its update figures are null in metrics.jsonl, not made up.
UPDATE_METRICS_WHEN_SKIPPED = dict.fromkeys(
    ("loss", "clip_fraction", "ratio_mean", "ratio_min", "ratio_max", "mismatch_abs_log_ratio_mean",
     "mismatch_abs_log_ratio_max", "mismatch_out_of_band_fraction", "grad_norm", "minibatches", "lr",
     "router_max_over_mean_load"))


def _update_metrics(per_seq, losses, grad_norms, config: Config) -> dict:
    low, high = config.loss.clip_low, config.loss.clip_high
    log_ratio = torch.tensor([lr for _, lr, _ in per_seq], dtype=torch.float64)
    advantage = torch.tensor([a for _, _, a in per_seq], dtype=torch.float64)
    ratio = log_ratio.exp()
    clipped = ((advantage > 0) & (ratio > 1 + high)) | ((advantage < 0) & (ratio < 1 - low))
    first = torch.tensor([tag == (0, 0) for tag, _, _ in per_seq])
    # theta == theta_old on the first minibatch: its log-ratio is pure engine/trainer mismatch.
    mismatch = log_ratio[first].abs()
    out_of_band = ((ratio[first] > 1 + high) | (ratio[first] < 1 - low)).double()
    return {
        "loss": sum(losses) / len(losses),
        "clip_fraction": clipped.double().mean().item(),
        "ratio_mean": ratio.mean().item(), "ratio_min": ratio.min().item(), "ratio_max": ratio.max().item(),
        "mismatch_abs_log_ratio_mean": mismatch.mean().item(),
        "mismatch_abs_log_ratio_max": mismatch.max().item(),
        "mismatch_out_of_band_fraction": out_of_band.mean().item(),
        "grad_norm": sum(grad_norms) / len(grad_norms),
    }


# ---------------------------------------------------------------- the run


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="gspo-train", description="GSPO training of a Qwen3-MoE on Megatron-Core")
    parser.add_argument("--config", required=True)
    parser.add_argument("--output-dir", default=None, help="default: runs/<config name>")
    parser.add_argument("--resume", action="store_true", help="continue from OUTPUT_DIR's last checkpoint")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    return parser.parse_intermixed_args(argv)


def run(config: Config, output_dir: Path, resume: bool) -> dict:
    from gspo_mcore.models.qwen3_moe.bootstrap import model_from_config
    from gspo_mcore.optimizer import setup_training
    from gspo_mcore.rollout.engine_control import EngineControl
    from gspo_mcore.run_io import Progress, RunLog, TrainState
    from gspo_mcore.weight_sync import (DistributedWeightSync, TensorWeightSync, check_sync, push_from_disk,
                                       save_hf_checkpoint)

    torch.manual_seed(config.train.seed)
    arch, model = model_from_config(config)
    ddp, optimizer = setup_training(model, config.optimizer)
    rank = dist.get_rank()
    output_dir.mkdir(parents=True, exist_ok=True)
    state = TrainState(output_dir)
    if resume:
        state.latest()  # no checkpoint: fail now, not after the servers started
    with ExitStack() as stack:
        source = RolloutSource(config) if rank == 0 else None
        if source is not None:
            stack.callback(source.close)
        urls = list(config.rollout.urls)
        if not urls and rank == 0:
            urls = start_servers(config, output_dir, stack)
        shared = [urls]
        dist.broadcast_object_list(shared, src=0)
        urls = shared[0]
        control = EngineControl(urls, timeout_s=config.rollout.request_timeout_s)
        if source is not None:
            source.connect(urls, arch.vocab_size)
        start_step = 0
        if resume:
            start_step, extra = state.load(ddp, optimizer)
            if source is not None:
                source.load_state_dict(extra["rollout"])
        router = RouterLoad(model, arch.num_layers, arch.num_experts)
        engine_dtype = DTYPES[config.rollout.engine_dtype]
        sync = None
        if config.weight_sync.method == "distributed":
            sync = DistributedWeightSync(model, arch, config.model.spec, control,
                                         backend="gloo" if config.distributed.device == "cpu" else "nccl",
                                         master_address=config.weight_sync.master_address,
                                         bucket_bytes=config.weight_sync.bucket_mb << 20, dtype=engine_dtype)
            stack.callback(sync.close)
        elif config.weight_sync.method == "tensor":
            sync = TensorWeightSync(model, arch, config.model.spec, control,
                                    bucket_bytes=config.weight_sync.bucket_mb << 20, dtype=engine_dtype)

        def push(version: str):
            if sync is not None:
                sync.push(version)
            else:
                disk = Path(config.weight_sync.disk_dir or output_dir / "weights_sync")
                save_hf_checkpoint(model, arch, config.model.spec, disk, config.model.hf_dir)
                if rank == 0:
                    push_from_disk(control, disk, version)
                dist.barrier()

        # Whatever the engine holds (model.hf_dir at start-up, a previous run's weights on a
        # long-lived server, older weights on a resume), it now gets the trainer's.
        version = f"step-{start_step}"
        push(version)
        log = RunLog(output_dir) if rank == 0 else None
        progress = Progress(config.train.steps, start_step) if rank == 0 else None
        summary, probes = {}, []
        for step in range(start_step, config.train.steps):
            timer = time.perf_counter()
            batch = [None]
            if rank == 0:
                batch = [source.collect(step, version)]
            dist.broadcast_object_list(batch, src=0)
            rollouts, advantages, metrics = batch[0]
            rollout_s = time.perf_counter() - timer
            timer = time.perf_counter()
            if config.weight_sync.colocate and rank == 0:
                control.release_memory()
            if config.train.recompute_old_logprobs:
                recompute_logprobs(ddp, rollouts, advantages, config)
            router.reset()
            metrics.update(UPDATE_METRICS_WHEN_SKIPPED)
            if rollouts:
                metrics.update(train_on_batch(ddp, optimizer, rollouts, advantages, config, step))
                metrics["router_max_over_mean_load"] = router.imbalance()
            train_s = time.perf_counter() - timer
            timer = time.perf_counter()
            if config.weight_sync.colocate and rank == 0:
                control.resume_memory()
            version = f"step-{step + 1}"
            push(version)
            # Probes: sequences of the latest batch that had any (the same on every rank).
            probes = [r.prompt_ids + r.response_ids for r in rollouts[:4]] or probes
            if config.weight_sync.check_every and (step + 1) % config.weight_sync.check_every == 0 and probes:
                metrics.update(check_sync(model, control, probes, config.weight_sync.check_tolerance))
            sync_s = time.perf_counter() - timer
            tokens = sum(len(r.prompt_ids) + len(r.response_ids) for r in rollouts)
            total = rollout_s + train_s + sync_s
            metrics.update(step=step + 1, time_rollout_s=rollout_s, time_train_s=train_s, time_sync_s=sync_s,
                           time_step_s=total, tokens_per_s=tokens / total, samples=len(rollouts))
            if config.train.save_every and (step + 1) % config.train.save_every == 0 and step + 1 < config.train.steps:
                state.save(ddp, optimizer, step + 1, {"rollout": source.state_dict() if source else None})
            if rank == 0:
                log.write(metrics)
                progress.update(metrics)
            summary = metrics
        state.save(ddp, optimizer, config.train.steps, {"rollout": source.state_dict() if source else None})
        if config.train.export_hf:
            save_hf_checkpoint(model, arch, config.model.spec, output_dir / "hf", config.model.hf_dir)
        if rank == 0:
            log.close()
    return summary


def main(argv=None) -> None:
    args = parse_args(argv)
    config = load_config(args.config, args.overrides)
    output_dir = Path(args.output_dir or Path("runs") / Path(args.config).stem)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run(config, output_dir, args.resume)
    dist.barrier()
    dist.destroy_process_group()


def cli() -> None:
    sys.exit(run_cli(main))


if __name__ == "__main__":
    cli()
