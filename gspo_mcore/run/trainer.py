"""The GSPO trainer: rollout -> reward -> GSPO update on Megatron -> weight sync, per step.

    gspo-train --config FILE [--output-dir DIR] [--resume] [key=value ...]   (gspo_mcore.run.cli)
    python -m gspo_mcore.train ...   (plain python for one process, or under torchrun)

Each step (`Trainer.step`):
1. rank 0 asks the engine for `group_size` responses to each of `rollout_batch_size`
   prompts; the engine returns token ids and per-token log-probs (GSPO's pi_old);
2. rewards, group-normalised advantages, groups without signal dropped (dynamic sampling,
   with more rounds of generation until the batch is full, up to `max_sampling_rounds`);
3. the batch is split into `num_minibatches`, each balanced across data-parallel ranks and
   packed into microbatches by a token budget; one optimizer step per minibatch with the GSPO
   loss (gspo_mcore.megatron.learner: the first minibatch on-policy from its own forward, the later
   ones against the engine's log-probs; no separate old-policy forward);
4. the new weights are pushed to the engine, tagged with the next weight version.
`Trainer.run` repeats it, with the checkpoint cadence and the metrics.

The Trainer takes its components from a builder (`build_parts`: the learner, the engine, the
weight sync, the checkpoints, and rank 0's side of the run), so the loop also runs with stand-ins
(tests/test_trainer_loop.py). Rank 0's own work (rollouts, evaluation, metrics, what the run says)
is behind one object, `RankZero`, with a no-op twin on the other ranks (`OtherRank`): a step reads
top to bottom on every rank, and its collectives are statements in it.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import signal
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from gspo_mcore import engines, weight_sync

from gspo_mcore.run import exactness

from gspo_mcore.run import saved_config
from gspo_mcore.planner import memory_model
from gspo_mcore.megatron.checkpointing import Checkpointer, MegatronState, SchedulerState
from gspo_mcore.config import Config
from gspo_mcore.common.errors import EngineError, InputError
from gspo_mcore.evaluation.held_out import Evaluator
from gspo_mcore.common.http import api_key_from_env
from gspo_mcore.megatron.learner import Learner
from gspo_mcore.run.memory import peak_memory_gb, release_cached_memory, reset_peak
from gspo_mcore.run.utilization import device_peak_flops, step_utilization
from gspo_mcore.metrics.schema import ASYNC_METRICS, UPDATE
from gspo_mcore.metrics.report import Progress, RunLog
from gspo_mcore.megatron.qwen3_moe.bootstrap import join_process_groups
from gspo_mcore.megatron.parallel import broadcast_from_host
from gspo_mcore.run.preemption import Preempted, StopRequest
from gspo_mcore.rollout.producer import build_producer
from gspo_mcore.rollout.source import RolloutSource
from gspo_mcore.megatron.routing_delivery import deliver_routing, take_routing
from gspo_mcore.run.directory import clear_run
from gspo_mcore.run.sample_log import write_samples
from gspo_mcore.run.summary import write_summary
from gspo_mcore.batch.rollout import Batch


@contextmanager
def timed(metrics: dict, key: str):
    began = time.perf_counter()
    yield
    metrics[key] = time.perf_counter() - began


class RankZero:
    """Rank 0's share of a run, which no other rank does: the rollout source and its producer (a
    registered checkpoint part, "rollout"), the held-out evaluation, a colocated engine's memory,
    the metrics sinks and the progress line, and what the run says. Every other rank holds its
    no-op twin, `OtherRank`."""

    writes = True  # the files only one rank writes (the strict-exactness evidence)

    def __init__(self, config: Config, output_dir: Path, source, producer, evaluator, engine, stop: StopRequest,
                 stack: ExitStack):
        self.config, self.output_dir = config, output_dir
        self.source, self.producer, self.evaluator, self.engine = source, producer, evaluator, engine
        self.stop, self.stack = stop, stack
        self.log: RunLog | None = None
        self.progress: Progress | None = None

    def say(self, line: str, stream=None) -> None:
        print(line, file=stream or sys.stdout, flush=True)

    def summarize(self) -> None:
        """The run's summary lines (first and last steps' reward, held-out before and after) and
        OUTPUT_DIR/summary.json (gspo_mcore.run.summary)."""
        for line in write_summary(self.output_dir):
            self.say(line)

    def begin(self, start_step: int, version: str, resumed_from: Path | None) -> None:
        """Once the engine holds the trainer's weights `version`: the producer starts generating with
        them; the sinks open (the run's files are written only now: bad input found before leaves
        none); a new run evaluates its starting point."""
        config = self.config
        self.producer.start(start_step)
        self.log = RunLog(self.output_dir, start_step, config.train.wandb_project, dataclasses.asdict(config))
        self.stack.callback(self.log.close)
        saved_config.save(config, self.output_dir)  # what a --resume is compared with
        if resumed_from is not None:
            self.say(f"resumed from {resumed_from.relative_to(self.output_dir)} "
                     f"(step {start_step} of {config.train.steps})")
        elif self.evaluator is not None:  # the starting point, before any update
            self.evaluate(0, version)
        self.progress = Progress(config.train.steps, start_step)

    def rollout(self, step: int) -> tuple[Batch | None, list | None]:
        """(this step's batch, its rollouts' routed experts taken off it to be sent apart:
        gspo_mcore.megatron.routing_delivery), or (None, None) when a signal abandoned it."""
        self.stop.phase = "rollout"
        try:
            batch = self.producer.get_batch(step)
        except Preempted:
            return None, None
        finally:
            self.stop.phase = "step"
        return take_routing(batch) if self.config.rollout.return_routed_experts else (batch, None)

    def pause(self) -> None:
        """Before a push: asynchronous modes' requests keep their tokens; the push needs no wait."""
        self.producer.pause()

    def resume(self, version: int) -> None:
        self.producer.resume(version)

    def release_engine_memory(self) -> None:
        self.engine.release_memory()

    def resume_engine_memory(self) -> None:
        self.engine.resume_memory()

    def evaluate(self, done: int, version: str) -> dict:
        """The eval datasets on the engine, which holds the weights `version` (after `done` steps)."""
        metrics = self.evaluator.run(self.source.client, version)
        self.say(f"eval of {version}: " + ", ".join(
            [f"{k} {v:.3f}" for k, v in metrics.items() if "/mean@" in k or "/pass@1" in k or "/greedy" in k]
            + [f"{k} {v:.0%}" for k, v in metrics.items() if k.endswith("_fraction") and v]))
        self.log.write_eval(done, version, metrics)
        return metrics

    def record(self, row: dict, rollouts: list, advantages: list, version: str) -> None:
        """Once step `row["step"]` is trained and pushed: the evaluation when due (its figures join
        the row) and the samples when due (the step's rollouts with their advantages), then the row
        to the sinks and the progress line."""
        cfg, done, evaluated = self.config, row["step"], {}
        if self.evaluator is not None and ((cfg.eval.every and done % cfg.eval.every == 0) or done == cfg.train.steps):
            evaluated = self.evaluate(done, version)
        every = cfg.train.log_samples_every
        if every and done % every == 0:
            write_samples(self.output_dir / "samples" / f"step_{done:06d}.jsonl", self.source.tokenizer,
                          rollouts[: cfg.train.log_samples], self.evaluator.last_samples if evaluated else [],
                          advantages)
        row.update(evaluated)
        self.log.write(row)
        self.progress.update(row)


class OtherRank:
    """RankZero's no-op twin, on every rank but 0: it holds no rollout side and says nothing."""

    writes = False

    def say(self, line: str, stream=None) -> None:
        pass

    def summarize(self) -> None:
        pass

    def begin(self, start_step: int, version: str, resumed_from: Path | None) -> None:
        pass

    def rollout(self, step: int) -> tuple[None, None]:
        return None, None  # the batch comes from rank 0 (broadcast_from_host)

    def pause(self) -> None:
        pass

    def resume(self, version: int) -> None:
        pass

    def release_engine_memory(self) -> None:
        pass

    def resume_engine_memory(self) -> None:
        pass

    def record(self, row: dict, rollouts: list, advantages: list, version: str) -> None:
        pass


@dataclasses.dataclass
class TrainerParts:
    """What the Trainer's loop drives, built on every rank by a builder (`build_parts`, or a
    test's stand-ins). `checkpoints` has every part of the training state registered."""

    learner: Learner  # update, scheduler, routing_wanted, routers, model, arch
    engine: object  # gspo_mcore.engines.Engine: urls (the rest through `host` and `sync`)
    sync: object  # gspo_mcore.weight_sync: push(version), close()
    host: RankZero | OtherRank
    checkpoints: Checkpointer


Builder = Callable[..., TrainerParts]


def build_parts(config: Config, output_dir: Path, *, resume: bool, overwrite: bool, stop: StopRequest,
                stack: ExitStack) -> TrainerParts:
    """The real components, built collectively on every rank, in this order: the process groups
    (first, the layout checked), the learner, the checkpoints (a resume without one fails here),
    rank 0's rollout source, the servers (started unless `rollout.urls` names them), the engine,
    the weight sync, rank 0's producer (not started). What each starts, `stack` releases."""
    arch = join_process_groups(config)
    learner = Learner(config, arch)
    stack.callback(learner.close)  # released last; the process groups are the run's (gspo_mcore.run.start ends them)
    rank_zero = dist.get_rank() == 0
    if overwrite and rank_zero:
        clear_run(output_dir)
    dist.barrier()
    checkpoints = Checkpointer(output_dir, learner.ddp.module, keep=config.train.keep_checkpoints)
    checkpoints.register("model", MegatronState(learner.ddp, learner.optimizer))
    checkpoints.register("lr_scheduler", SchedulerState(learner.scheduler, learner.optimizer,
                                                        checkpoints.train_state))
    if resume:
        checkpoints.latest()  # no checkpoint: fail now, not after the servers started
    source = _rollout_source(config, output_dir, stack) if rank_zero else None
    evaluator = Evaluator(config, source.tokenizer, source.generator) if source and config.eval.datasets else None
    if evaluator is not None:
        stack.callback(evaluator.close)
    # The servers' API key (a run's own servers get one made for it) on every rank: weight-sync
    # owners on any rank call the servers.
    urls, key = broadcast_from_host(_servers(config, output_dir, stack) if rank_zero else None)
    engine = engines.connect(config, urls, key)
    sync = weight_sync.build(config, learner.model, learner.arch, engine, output_dir)
    stack.callback(sync.close)
    host = OtherRank()
    if rank_zero:
        _connect(config, learner.arch, source, engine, stop)
        producer = build_producer(source, engine)
        stack.callback(producer.close)
        # The data position before the batch in flight (the producer knows it), loaded before it starts.
        checkpoints.register("rollout", producer)
        host = RankZero(config, output_dir, source, producer, evaluator, engine, stop, stack)
    return TrainerParts(learner, engine, sync, host, checkpoints)


def _rollout_source(config: Config, output_dir: Path, stack: ExitStack) -> RolloutSource:
    source = RolloutSource(config)
    stack.callback(source.close)
    source.error_log = output_dir / "logs" / "reward_errors.log"
    return source


def _servers(config: Config, output_dir: Path, stack: ExitStack) -> tuple[list[str], str | None]:
    """(URLs, API key): the config's servers with the key the launch scripts handed the run,
    or the servers this run starts, behind a key made for them."""
    if config.rollout.urls:
        return list(config.rollout.urls), api_key_from_env()
    key = api_key_from_env() or secrets.token_hex(16)
    return engines.start_servers(config, output_dir / "logs", stack, api_key=key), key


def _connect(config: Config, arch, source: RolloutSource, engine, stop: StopRequest) -> None:
    """Rank 0's rollout client: as many requests in flight as the servers run at once with room
    in their KV caches for a full-length request each (their own limits, whoever started
    them), less one slot per server kept free for the sync check's probes."""
    routing_shape = (arch.num_layers, arch.num_experts_per_tok) if config.rollout.return_routed_experts else None
    tokens = source.request_tokens()
    slots = [engine.capacity(url, config.rollout.max_running_requests, tokens) for url in engine.urls]
    in_flight = engines.requests_in_flight(slots)
    source.connect(engine, arch.vocab_size, routing_shape, max_concurrency=in_flight)
    print(f"rollout: up to {in_flight} requests in flight ({' + '.join(map(str, slots))} the servers run at once "
          f"with KV room for {tokens} tokens each, one per server kept for the sync check)", flush=True)
    stop.on_abandon = source.client.close  # a signal mid-rollout aborts the requests in flight


class Trainer:
    """Built collectively on every rank from its parts (`build`: `build_parts` unless a test gives
    stand-ins): loads a resume's checkpoint, gives the engine the trainer's weights, then
    `run` trains to `train.steps` and releases everything the parts started."""

    def __init__(self, config: Config, output_dir: Path, resume: bool = False, overwrite: bool = False,
                 build: Builder = build_parts):
        self.config, self.output_dir = config, Path(output_dir)
        self.stop = StopRequest()  # until the first step: a signal stops the run at once
        self.stack = ExitStack()
        try:
            parts = build(config, self.output_dir, resume=resume, overwrite=overwrite, stop=self.stop,
                          stack=self.stack)
            self.learner, self.engine, self.sync = parts.learner, parts.engine, parts.sync
            self.host, self.checkpoints = parts.host, parts.checkpoints
            self.start_step = self.checkpoints.load() if resume else 0
            # Whatever the engine holds (model.hf_dir at start-up, a previous run's weights on a
            # long-lived server, older weights on a resume), it now gets the trainer's.
            self.version = f"step-{self.start_step}"
            self.host.say(f"pushing the trainer's weights ({self.version}) to {len(self.engine.urls)} server(s) "
                          f"by {config.weight_sync.method}")
            self.sync.push(self.version)
            self.output_dir.mkdir(parents=True, exist_ok=True)
            self.host.begin(self.start_step, self.version, self.checkpoints.latest() if resume else None)
        except BaseException:
            self.stack.close()
            raise
        self.probes: list[tuple[list[int], int]] = []  # (tokens, first response token)
        self.last_rollouts: list = []
        self.last_advantages: list = []
        self.peak_gb = 0.0
        self.peak_flops = device_peak_flops(config, self.host.say)  # mfu / hfu's denominator; None on CPU

    def step(self, step: int) -> dict:
        """One rollout batch -> updates -> push (-> sync check). The step's row on every rank."""
        config, timings = self.config, {}
        reset_peak()
        with timed(timings, "time_rollout_s"):
            batch, metrics = self._prepared_batch(step)
        with timed(timings, "time_train_s"):
            if config.weight_sync.colocate:
                self.host.release_engine_memory()
                if config.optimizer.offload_grad_buffers:  # the engine's memory is free: the update's gradients
                    self.learner.restore_grad_buffers()
            self.learner.scheduler.step(1)  # this step's learning rate (optimizer.lr_warmup_steps, lr_decay)
            metrics.update(dict.fromkeys(UPDATE))  # null unless this step trains
            if batch.rollouts:
                metrics.update(self._update(batch, step))
        if batch.rollouts:
            metrics.update(step_utilization(config, self.learner.arch, batch.rollouts, timings["time_train_s"],
                                            dist.get_world_size(), self.peak_flops))
        with timed(timings, "time_sync_s"):
            metrics.update(self._push_and_check(step, batch))
        peak = peak_memory_gb()  # collective: the peak over the ranks
        self.last_rollouts, self.last_advantages = batch.rollouts, batch.advantages
        return self._row(step, batch, metrics, timings, peak)

    def _prepared_batch(self, step: int) -> tuple[Batch, dict]:
        """(this step's batch, its figures so far) on every rank, prepared once: rank 0's batch
        broadcast (the other ranks wait on the host group, gspo_mcore.megatron.parallel.host_group, not in an
        NCCL kernel), its minibatch split made, and with the engine's routed experts, each rank
        given its own rollouts' rows (those its shards of that split read)."""
        batch, routing = self.host.rollout(step)
        batch = broadcast_from_host(batch)  # collective
        if batch is None:  # rank 0 abandoned the rollout for a signal (gspo_mcore.run.preemption)
            raise Preempted()
        batch.minibatches = self.learner.minibatch_split(len(batch.rollouts), step)
        metrics = dict(batch.metrics)
        metrics["routing_mb_per_rank_max"] = None
        if self.config.rollout.return_routed_experts:
            # Every rollout when the batch is forwarded whole first (pi_old / pi_prox, the strict check).
            wanted = self.learner.routing_wanted(batch.rollouts, batch.minibatches,
                                                 self._recompute(batch) or self.config.strict)
            metrics["routing_mb_per_rank_max"] = deliver_routing(batch, routing, wanted,  # collective
                                                                 self.learner.routers.layers)
        return batch, metrics

    def _row(self, step: int, batch: Batch, metrics: dict, timings: dict, peak_gb: float) -> dict:
        """The step's metrics row: every figure of the schema's asynchronous rows (null in sync mode)."""
        rollouts, total = batch.rollouts, sum(timings.values())
        tokens = sum(len(r.prompt_ids) + len(r.response_ids) for r in rollouts)
        waited = metrics.pop("trainer_wait_s")
        return {**dict.fromkeys(ASYNC_METRICS), **metrics, "step": step + 1, **timings, "time_step_s": total,
                "trained_tokens_per_s": tokens / total, "generated_tokens_per_s": metrics["tokens_generated"] / total,
                "samples": len(rollouts), "samples_per_s": len(rollouts) / total, "peak_memory_gb": peak_gb,
                **({"trainer_wait_s": waited, "trainer_idle_fraction": waited / total} if batch.overlapped else {})}

    def _update(self, batch: Batch, step: int) -> dict:
        """The learner's update. A batch that spans weight versions (its `stale` marks): decoupled
        GSPO, pi_prox (this step's weights) from a forward of the batch (loss.proximal); else pi_old
        is the engine's log-probs (or recomputed: train.recompute_old_logprobs). Strict exactness
        (Config.strict): that forward, or one of its own, compared with the engine's log-probs
        first (gspo_mcore.run.exactness: every rank the same verdict, rank 0 writes the evidence)."""
        old = self.learner.recompute_old_logprobs(batch.rollouts) if self._recompute(batch) else None
        strict = {}
        if self.config.strict:  # before the update: theta_old
            at_old = old if old is not None else self.learner.recompute_old_logprobs(batch.rollouts)
            strict["exactness_abs_log_ratio_max"] = exactness.check(
                batch.rollouts, at_old, batch.stale, step=step, version=self.version,
                tolerance=self.config.train.strict_exactness_tolerance, log_dir=self.output_dir / "logs",
                write=self.host.writes)
        return {**self.learner.update(batch, step, old), **strict}

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
            if config.optimizer.offload_grad_buffers:  # room for the engine's KV cache until the next update
                self.learner.offload_grad_buffers()
            release_cached_memory()  # the training peak must not stay reserved beside the engine
            dist.barrier()
            self.host.resume_engine_memory()
        self.version = f"step-{step + 1}"
        paused = time.perf_counter()
        self.host.pause()
        dist.barrier()
        self.sync.push(self.version)
        dist.barrier()
        self.host.resume(step + 1)
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
                                              config.sync_check_tolerance, list(scored_from),
                                              fused_logprobs=config.model.fused_logprobs))
        release_cached_memory()  # the check forward's logits
        return figures

    def _resume_hint(self) -> str:
        try:
            return f"--resume continues from {self.checkpoints.latest().name}"
        except InputError:
            return "no checkpoint yet (train.save_every), a new run starts over"

    def run(self) -> dict:
        """Steps start_step..train.steps, checkpoints every `save_every` and at the end, the HF
        export; everything the run started is released, also on failure."""
        cfg, row = self.config.train, {}
        with self.stack:
            self.stop.phase = "step"  # from here a signal saves the last completed step (gspo_mcore.run.preemption)
            for step in range(self.start_step, cfg.steps):
                try:
                    row = self.step(step)
                except EngineError as err:  # an engine gone for good
                    raise EngineError(f"{err}; the run stops at step {step + 1}: {self._resume_hint()}") from None
                except Preempted:
                    self._stop_for_signal(step)
                saved = cfg.save_every and (step + 1) % cfg.save_every == 0 and step + 1 < cfg.steps
                if saved:
                    self.checkpoints.save(step + 1)
                self.host.record(row, self.last_rollouts, self.last_advantages, self.version)
                self.peak_gb = max(self.peak_gb, row["peak_memory_gb"])
                if step + 1 < cfg.steps and self.stop.requested_anywhere():  # collective
                    self._stop_for_signal(step + 1, saved=bool(saved))
            self.stop.phase = None
            if cfg.save_final:
                self.checkpoints.save(cfg.steps)
            if cfg.export_hf:
                self.checkpoints.export_hf(self.learner.arch, self.config.model.spec, self.config.model.hf_dir)
        self.host.summarize()
        self.host.say(self._memory_line())
        self.host.say(self._outputs_line())
        return row

    def _outputs_line(self) -> str:
        """Where the run's results are, at its end."""
        out, cfg = self.output_dir, self.config.train
        parts = [f"metrics {out / 'metrics.jsonl'} (TensorBoard: {out / 'tensorboard'})"]
        if cfg.save_final or cfg.save_every:
            parts.append(f"checkpoints {out / 'checkpoints'} (--resume continues)")
        if cfg.export_hf:
            parts.append(f"Hugging Face weights {out / 'hf'} (transformers, SGLang, vLLM)")
        parts.append(f"logs {out / 'logs'}; plots: python -m gspo_mcore.run.plot {out}")
        return "outputs: " + "; ".join(parts)

    def _stop_for_signal(self, done: int, saved: bool = False) -> None:
        """A signal (here or on another rank): checkpoint `done` completed steps, exit 128 + signal."""
        signum = self.stop.requested_anywhere()  # collective
        self.stop.phase = None  # a second signal while saving: stop at once
        if not saved and done > self.start_step:
            self.checkpoints.save(done)
        name = signal.Signals(signum).name
        if done > self.start_step or saved:
            self.host.say(f"stopped by {name} after step {done} (checkpoints/step_{done:06d}): --resume continues",
                          sys.stderr)
        else:
            self.host.say(f"stopped by {name} before a step completed: {self._resume_hint()}", sys.stderr)
        raise SystemExit(128 + signum)

    def _memory_line(self) -> str:
        """The run's peak memory beside the planner's estimate (GPU): a first run checks the planner."""
        if not torch.cuda.is_available():
            return f"peak resident memory per rank: {self.peak_gb:.1f} GiB"
        gpus = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        layout = memory_model.check_layout(self.config, self.learner.arch, max(1, dist.get_world_size() // gpus), gpus)
        estimate = memory_model.memory_estimate(self.config, self.learner.arch, layout)["trainer_total_gb"]
        return (f"peak CUDA memory allocated per rank: {self.peak_gb:.1f} GiB; the planner's estimate for the "
                f"trainer's training phase: {estimate:.1f} GiB (python -m gspo_mcore.planner.cli)")
