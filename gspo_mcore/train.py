"""The GSPO trainer: rollout -> reward -> GSPO update on Megatron -> weight sync, per step.

    gspo-train --config FILE [--output-dir DIR] [--resume] [key=value ...]   (gspo_mcore.cli)
    python -m gspo_mcore.train ...   (plain python for one process, or under torchrun)

Each step (`Trainer.step`):
1. rank 0 asks the engine for `group_size` responses to each of `rollout_batch_size`
   prompts; the engine returns token ids and per-token log-probs (GSPO's pi_old);
2. rewards, group-normalised advantages, groups without signal dropped (dynamic sampling,
   with more rounds of generation until the batch is full, up to `max_sampling_rounds`);
3. the batch is split into `num_minibatches`, each balanced across data-parallel ranks and
   packed into microbatches by a token budget; one optimizer step per minibatch with the GSPO
   loss (gspo_mcore.learner: the first minibatch on-policy from its own forward, the later
   ones against the engine's log-probs; no separate old-policy forward);
4. the new weights are pushed to the engine, tagged with the next weight version.
`Trainer.run` repeats it, with the checkpoint cadence and the metrics.
"""

from __future__ import annotations

if __name__ == "__main__":
    # `python -m gspo_mcore.train`: the command line (gspo_mcore.cli) before this module's heavy
    # imports, so `--help` and usage errors answer at once; a run imports this module by name.
    from gspo_mcore.cli import train_cli

    train_cli()

import dataclasses
import os
import secrets
import signal
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from gspo_mcore import engines, exactness, plan, run_config, weight_sync
from gspo_mcore.checkpointing import Checkpointer, FunctionState, MegatronState, SchedulerState
from gspo_mcore.config import Config
from gspo_mcore.errors import EngineError, InputError
from gspo_mcore.evaluation import Evaluator
from gspo_mcore.http import api_key_from_env
from gspo_mcore.learner import Learner
from gspo_mcore.memory import peak_memory_gb, release_cached_memory, reset_peak
from gspo_mcore.metric_schema import ASYNC_METRICS, UPDATE
from gspo_mcore.metrics import Progress, RunLog
from gspo_mcore.parallel import broadcast_from_host
from gspo_mcore.preemption import Preempted, StopRequest
from gspo_mcore.rollout.producer import make_producer
from gspo_mcore.rollout.source import RolloutSource
from gspo_mcore.routing_delivery import deliver_routing, take_routing
from gspo_mcore.run_dir import clear_run
from gspo_mcore.sample_log import write_samples
from gspo_mcore.samples import Batch


@contextmanager
def timed(metrics: dict, key: str):
    began = time.perf_counter()
    yield
    metrics[key] = time.perf_counter() - began


class Trainer:
    """Built collectively on every rank: the learner (model, optimizer), the rollout source (rank
    0), the servers (started by the run unless `rollout.urls` names them), the weight sync, the
    checkpoints and the metrics. `run` trains to `train.steps` and releases all of it."""

    def __init__(self, config: Config, output_dir: Path, resume: bool = False, overwrite: bool = False):
        self.config, self.output_dir = config, Path(output_dir)
        self.stop = StopRequest()  # until the first step: a signal stops the run at once
        self.learner = Learner(config)
        self.rank = dist.get_rank()
        if overwrite and self.rank == 0:
            clear_run(self.output_dir)
        dist.barrier()
        self.checkpoints = Checkpointer(self.output_dir, self.learner.ddp.module, keep=config.train.keep_checkpoints)
        self.checkpoints.register("model", MegatronState(self.learner.ddp, self.learner.optimizer))
        self.checkpoints.register("lr_scheduler", SchedulerState(self.learner.scheduler, self.learner.optimizer,
                                                                 self.checkpoints.train_state))
        if resume:
            self.checkpoints.latest()  # no checkpoint: fail now, not after the servers started
        self.stack = ExitStack()
        try:
            self.source = RolloutSource(config) if self.rank == 0 else None
            if self.source is not None:
                self.stack.callback(self.source.close)
                self.source.error_log = self.output_dir / "logs" / "reward_errors.log"
            self.evaluator = (Evaluator(config, self.source.tokenizer, self.source.generator)
                              if self.source and config.eval.datasets else None)
            if self.evaluator is not None:
                self.stack.callback(self.evaluator.close)
            # The servers' API key (a run's own servers get one made for it) on every rank:
            # weight-sync owners on any rank call the servers.
            urls, key = broadcast_from_host(self._servers() if self.rank == 0 else None)
            self.engine = engines.connect(config, urls, key)
            if self.source is not None:
                self._connect()
                # Saved from the producer (the data position before its batch in flight), loaded into
                # the source before the producer starts.
                self.checkpoints.register("rollout", FunctionState(lambda: self.producer.state_dict(),
                                                                   self.source.load_state_dict))
            self.start_step = self.checkpoints.load() if resume else 0
            self.sync = weight_sync.build(config, self.learner.model, self.learner.arch, self.engine, self.output_dir)
            self.stack.callback(self.sync.close)
            # Whatever the engine holds (model.hf_dir at start-up, a previous run's weights on a
            # long-lived server, older weights on a resume), it now gets the trainer's.
            self.version = f"step-{self.start_step}"
            if self.rank == 0:
                print(f"pushing the trainer's weights ({self.version}) to {len(urls)} server(s) "
                      f"by {config.weight_sync.method}", flush=True)
            self.sync.push(self.version)
            # After the first push: asynchronous producers start generating with these weights.
            self.producer = make_producer(self.source, self.start_step, self.engine) if self.source is not None else None
            if self.producer is not None:
                self.stack.callback(self.producer.close)
            # Created only now: bad input found above (prompts, reward, servers) leaves no directory.
            self.output_dir.mkdir(parents=True, exist_ok=True)
            self.log = self._open_log(resume) if self.rank == 0 else None
            if self.evaluator is not None and not resume:  # the starting point, before any update
                self.log.write_eval(0, self.version, self._evaluate())
            self.progress = Progress(config.train.steps, self.start_step) if self.rank == 0 else None
            self.probes: list[tuple[list[int], int]] = []  # (tokens, first response token)
            self.peak_gb = 0.0
        except BaseException:
            self.stack.close()
            raise

    def _connect(self) -> None:
        """Rank 0's rollout client: as many requests in flight as the servers run at once with room
        in their KV caches for a full-length request each (their own limits, whoever started
        them), less one slot per server kept free for the sync check's probes."""
        config, arch = self.config, self.learner.arch
        routing_shape = (arch.num_layers, arch.num_experts_per_tok) if config.rollout.return_routed_experts else None
        tokens = self.source.request_tokens()
        slots = [self.engine.capacity(url, config.rollout.max_running_requests, tokens) for url in self.engine.urls]
        in_flight = engines.requests_in_flight(slots)
        self.source.connect(self.engine, arch.vocab_size, routing_shape, max_concurrency=in_flight)
        print(f"rollout: up to {in_flight} requests in flight ({' + '.join(map(str, slots))} the servers run at once "
              f"with KV room for {tokens} tokens each, one per server kept for the sync check)", flush=True)
        self.stop.on_abandon = self.source.client.close  # a signal mid-rollout aborts the requests in flight

    def _open_log(self, resume: bool) -> RunLog:
        """Rank 0: the metrics sinks, the run's config.yaml (what a --resume is compared with)."""
        config = self.config
        log = RunLog(self.output_dir, self.start_step, config.train.wandb_project, dataclasses.asdict(config))
        self.stack.callback(log.close)
        run_config.save(config, self.output_dir)
        if resume:
            print(f"resumed from {self.checkpoints.latest().relative_to(self.output_dir)} "
                  f"(step {self.start_step} of {config.train.steps})", flush=True)
        return log

    def _servers(self) -> tuple[list[str], str | None]:
        """(URLs, API key): the config's servers with the key the launch scripts handed the run,
        or the servers this run starts, behind a key made for them."""
        if self.config.rollout.urls:
            return list(self.config.rollout.urls), api_key_from_env()
        key = api_key_from_env() or secrets.token_hex(16)
        return engines.start_servers(self.config, self.output_dir / "logs", self.stack, api_key=key), key

    def step(self, step: int) -> dict:
        """One rollout batch -> updates -> push (-> sync check). Metrics on every rank."""
        config, timings = self.config, {}
        reset_peak()
        with timed(timings, "time_rollout_s"):
            batch = self._rollout(step) if self.producer else None
            routing = None
            if batch is not None and config.rollout.return_routed_experts:
                batch, routing = take_routing(batch)  # sent apart: each rank its own rows
            # The other ranks wait on the host (gspo_mcore.parallel.host_group), not in an NCCL kernel.
            batch = broadcast_from_host(batch)
            if batch is None:  # rank 0 abandoned the rollout for a signal (gspo_mcore.preemption)
                raise Preempted()
            metrics = dict(batch.metrics)
            metrics["routing_mb_per_rank_max"] = None
            if config.rollout.return_routed_experts:
                # Every rollout when the batch is forwarded whole first (pi_old / pi_prox, the strict check).
                wanted = self.learner.routing_wanted(batch.rollouts, step, self._recompute(batch) or config.strict)
                metrics["routing_mb_per_rank_max"] = deliver_routing(batch, routing, wanted,
                                                                     self.learner.routers.layers)
        with timed(timings, "time_train_s"):
            if config.weight_sync.colocate and self.rank == 0:
                self.engine.release_memory()
            self.learner.scheduler.step(1)  # this step's learning rate (optimizer.lr_warmup_steps, lr_decay)
            metrics.update(dict.fromkeys(UPDATE))  # null unless this step trains
            if batch.rollouts:
                metrics.update(self._update(batch, step))
        with timed(timings, "time_sync_s"):
            metrics.update(self._push_and_check(step, batch))
        self.last_rollouts = rollouts = batch.rollouts
        total = sum(timings.values())
        tokens = sum(len(r.prompt_ids) + len(r.response_ids) for r in rollouts)
        waited = metrics.pop("trainer_wait_s")
        return {**dict.fromkeys(ASYNC_METRICS), **metrics, "step": step + 1, **timings, "time_step_s": total,
                "trained_tokens_per_s": tokens / total, "generated_tokens_per_s": metrics["tokens_generated"] / total,
                "samples": len(rollouts), "samples_per_s": len(rollouts) / total,
                "peak_memory_gb": peak_memory_gb(),
                **({"trainer_wait_s": waited, "trainer_idle_fraction": waited / total} if batch.overlapped else {})}

    def _evaluate(self) -> dict:
        """Rank 0: the eval datasets on the engine, which holds the weights just pushed."""
        metrics = self.evaluator.run(self.source.client, self.version)
        print(f"eval of {self.version}: " + ", ".join(f"{k} {v:.3f}" for k, v in metrics.items() if "/mean@" in k
                                                       or "/pass@1" in k or "/greedy" in k), flush=True)
        return metrics

    def _after_step(self, done: int) -> dict:
        """Rank 0, once `done` steps are trained and pushed: the evaluation when due (its figures
        join the step's row), and the samples when due."""
        cfg, metrics = self.config, {}
        if self.evaluator is not None and ((cfg.eval.every and done % cfg.eval.every == 0) or done == cfg.train.steps):
            metrics = self._evaluate()
            self.log.write_eval(done, self.version, metrics)
        every = cfg.train.log_samples_every
        if every and done % every == 0:
            write_samples(self.output_dir / "samples" / f"step_{done:06d}.jsonl", self.source.tokenizer,
                          self.last_rollouts[: cfg.train.log_samples], self.evaluator.last_samples if metrics else [])
        return metrics

    def _rollout(self, step: int):
        """Rank 0: this step's batch, or None when a signal abandoned it."""
        self.stop.phase = "rollout"
        try:
            return self.producer.get_batch(step)
        except Preempted:
            return None
        finally:
            self.stop.phase = "step"

    def _update(self, batch: Batch, step: int) -> dict:
        """The learner's update. A batch that spans weight versions (its `stale` marks): decoupled
        GSPO, pi_prox (this step's weights) from a forward of the batch (loss.proximal); else pi_old
        is the engine's log-probs (or recomputed: train.recompute_old_logprobs). Strict exactness
        (Config.strict): that forward, or one of its own, compared with the engine's log-probs
        first (gspo_mcore.exactness: every rank the same verdict, rank 0 writes the evidence)."""
        old = self.learner.recompute_old_logprobs(batch.rollouts) if self._recompute(batch) else None
        strict = {}
        if self.config.strict:  # before the update: theta_old
            at_old = old if old is not None else self.learner.recompute_old_logprobs(batch.rollouts)
            strict["exactness_abs_log_ratio_max"] = exactness.check(
                batch.rollouts, at_old, batch.stale, step=step, version=self.version,
                tolerance=self.config.train.strict_exactness_tolerance, log_dir=self.output_dir / "logs",
                write=self.rank == 0)
        return {**self.learner.update(batch.rollouts, batch.advantages, step, old, batch.stale,
                                      batch.routed_by_older), **strict}

    def _recompute(self, batch: Batch) -> bool:
        """Whether the trainer forwards the batch before its update: pi_old recomputed
        (train.recompute_old_logprobs) or, for a batch spanning versions, pi_prox (loss.proximal)."""
        if batch.stale is None:
            return self.config.train.recompute_old_logprobs
        return self.config.loss.proximal == "recompute"

    def _push_and_check(self, step: int, batch: Batch) -> dict:
        """The new weights to the engine, tagged step-N (and, every `check_every` steps, the proof)."""
        config = self.config
        if config.weight_sync.colocate:
            release_cached_memory()  # the training peak must not stay reserved beside the engine
            dist.barrier()
            if self.rank == 0:
                self.engine.resume_memory()
        self.version = f"step-{step + 1}"
        paused = time.perf_counter()
        if self.producer is not None:
            self.producer.pause()  # asynchronous modes: requests keep their tokens; the push needs no wait
        dist.barrier()
        self.sync.push(self.version)
        dist.barrier()
        if self.producer is not None:
            self.producer.resume(step + 1)
        pause_s = time.perf_counter() - paused
        release_cached_memory()  # the push's buckets: the rollout phase holds static state only
        # Probes: sequences of the latest batch that had any (the same on every rank).
        self.probes = [(r.prompt_ids + r.response_ids, len(r.prompt_ids)) for r in batch.rollouts[:4]] or self.probes
        every = config.weight_sync.check_every
        figures = {"engine_pause_s": pause_s if batch.overlapped else None}
        if not (every and (step + 1) % every == 0 and self.probes):
            return figures
        tokens, scored_from = zip(*self.probes)
        figures.update(weight_sync.check_sync(self.learner.model, self.engine, list(tokens),
                                              config.sync_check_tolerance, list(scored_from)))
        release_cached_memory()  # the check forward's logits
        return figures

    def _resume_hint(self) -> str:
        try:
            return f"--resume continues from {self.checkpoints.latest().name}"
        except InputError:
            return "no checkpoint yet (train.save_every), a new run starts over"

    def save(self, step: int) -> None:
        self.checkpoints.save(step)

    def run(self) -> dict:
        """Steps start_step..train.steps, checkpoints every `save_every` and at the end, the HF
        export; everything the run started is released, also on failure."""
        cfg, summary = self.config.train, {}
        with self.stack:
            self.stop.phase = "step"  # from here a signal saves the last completed step (gspo_mcore.preemption)
            for step in range(self.start_step, cfg.steps):
                try:
                    summary = self.step(step)
                except EngineError as err:  # an engine gone for good
                    raise EngineError(f"{err}; the run stops at step {step + 1}: {self._resume_hint()}") from None
                except Preempted:
                    self._stop_for_signal(step)
                saved = cfg.save_every and (step + 1) % cfg.save_every == 0 and step + 1 < cfg.steps
                if saved:
                    self.save(step + 1)
                if self.rank == 0:
                    summary.update(self._after_step(step + 1))
                    self.log.write(summary)
                    self.progress.update(summary)
                self.peak_gb = max(self.peak_gb, summary["peak_memory_gb"])
                if step + 1 < cfg.steps and self.stop.requested_anywhere():
                    self._stop_for_signal(step + 1, saved=bool(saved))
            self.stop.phase = None
            if cfg.save_final:
                self.save(cfg.steps)
            if cfg.export_hf:
                self.checkpoints.export_hf(self.learner.arch, self.config.model.spec, self.config.model.hf_dir)
        if self.rank == 0:
            print(self._memory_line(), flush=True)
            print(self._outputs_line(), flush=True)
        return summary

    def _outputs_line(self) -> str:
        """Where the run's results are, at its end."""
        out, cfg = self.output_dir, self.config.train
        parts = [f"metrics {out / 'metrics.jsonl'} (TensorBoard: {out / 'tensorboard'})"]
        if cfg.save_final or cfg.save_every:
            parts.append(f"checkpoints {out / 'checkpoints'} (--resume continues)")
        if cfg.export_hf:
            parts.append(f"Hugging Face weights {out / 'hf'} (transformers, SGLang, vLLM)")
        parts.append(f"logs {out / 'logs'}; plots: python -m gspo_mcore.plot {out}")
        return "outputs: " + "; ".join(parts)

    def _stop_for_signal(self, done: int, saved: bool = False) -> None:
        """A signal (here or on another rank): checkpoint `done` completed steps, exit 128 + signal."""
        signum = self.stop.requested_anywhere()
        self.stop.phase = None  # a second signal while saving: stop at once
        if not saved and done > self.start_step:
            self.save(done)
        if self.rank == 0:
            name = signal.Signals(signum).name
            if done > self.start_step or saved:
                print(f"stopped by {name} after step {done} (checkpoints/step_{done:06d}): --resume continues",
                      file=sys.stderr, flush=True)
            else:
                print(f"stopped by {name} before a step completed: {self._resume_hint()}", file=sys.stderr, flush=True)
        raise SystemExit(128 + signum)

    def _memory_line(self) -> str:
        """The run's peak memory beside the planner's estimate (GPU): a first run checks the planner."""
        if not torch.cuda.is_available():
            return f"peak resident memory per rank: {self.peak_gb:.1f} GiB"
        gpus = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        layout = plan.check_layout(self.config, self.learner.arch, max(1, dist.get_world_size() // gpus), gpus)
        estimate = plan.memory_estimate(self.config, self.learner.arch, layout)["trainer_total_gb"]
        return (f"peak CUDA memory allocated per rank: {self.peak_gb:.1f} GiB; the planner's estimate for the "
                f"trainer's training phase: {estimate:.1f} GiB (python -m gspo_mcore.plan)")

