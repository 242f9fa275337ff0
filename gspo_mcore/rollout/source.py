"""Prompts -> engine rollouts -> rewards -> advantages, with dynamic sampling (rank 0 only).

A step asks the engine for `group_size` responses to each prompt, scores them, turns rewards
into group-normalised advantages, keeps the groups `rollout.group_filter` chooses (by default
those with signal) and generates more rounds until `rollout_batch_size` groups are kept.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
from pathlib import Path

import torch

from gspo_mcore.gspo import advantages as adv
from gspo_mcore.config import Config
from gspo_mcore.data import PromptDataset, PromptSampler, chat_prompt_ids
from gspo_mcore.common.errors import InputError
from gspo_mcore.common.plugins import by_name
from gspo_mcore.rewards.code import step_figures
from gspo_mcore.rewards.runner import RewardRunner
from gspo_mcore.rollout.generation import Generator
from gspo_mcore.batch.rollout import Rollout
from gspo_mcore.common.seeds import rollout_seed


class RolloutSource:
    """Prompts -> engine rollouts -> rewards -> advantages, on rank 0."""

    def __init__(self, config: Config):
        """Loads the tokenizer, the dataset and the reward (bad input fails here, before any
        server starts); `connect` then names the servers."""
        from gspo_mcore.data.tokenizer import load_tokenizer  # transformers: rank 0's alone, not every rank's

        self.config = config
        self.tokenizer = load_tokenizer(config.data.tokenizer_dir or config.model.hf_dir)
        if not config.data.path:
            raise InputError("data.path: no prompt dataset given")
        self.dataset = PromptDataset.load(config.data.path, config.data.prompt_key, config.data.messages_key,
                                          config.data.answer_key)
        self.sampler = PromptSampler(len(self.dataset), seed=config.train.seed)
        self._check_template()
        reward = config.reward
        # The dataset's answers read by the reward here (the code rewards'), before any server starts.
        self.rewards = RewardRunner.from_config(reward, samples=self.dataset.samples)
        self.group_filter = by_name(config.rollout.group_filter, adv.GROUP_FILTERS, "rollout.group_filter")
        self.running = adv.RunningMoments()
        self.generator = Generator(config, self.tokenizer)  # the evaluation generates through it too
        self.client = None
        self.error_log: Path | None = None  # where reward failures are kept (the trainer: OUTPUT_DIR/logs)
        self.lock = threading.Lock()

    def _check_template(self) -> None:
        """The chat template renders the first record with data.chat_template_kwargs, or a one-line error."""
        try:
            chat_prompt_ids(self.tokenizer, self.dataset[0].messages, self.config.data.chat_template_kwargs)
        except Exception as err:  # jinja's errors, a keyword apply_chat_template takes itself
            raise InputError(f"data.chat_template_kwargs: the chat template fails on the first record "
                             f"({type(err).__name__}: {err})") from None

    def sampling_params(self) -> dict:
        """What each /generate request samples with (temperature only: see client.check_sampling_params)."""
        rollout = self.config.rollout
        params = {"max_new_tokens": rollout.max_new_tokens, "temperature": rollout.temperature}
        return {**params, "stop": list(rollout.stop)} if rollout.stop else params

    def request_tokens(self, sample: int = 64) -> int:
        """The KV room one request needs at full length: the longest of the first `sample` prompts
        (rendered) and every token a response (a rollout function's trajectory) may add."""
        rollout = self.config.rollout
        prompts = [chat_prompt_ids(self.tokenizer, self.dataset[i].messages, self.config.data.chat_template_kwargs)
                   for i in range(min(sample, len(self.dataset)))]
        added = rollout.max_new_tokens if self.generator.function is None else rollout.max_trajectory_tokens
        return max(map(len, prompts)) + added

    def connect(self, engine, vocab_size: int, routing_shape: tuple[int, int] | None = None,
                max_concurrency: int = 64) -> None:
        """`engine` (gspo_mcore.engines.Engine): the servers. `routing_shape` (MoE layers, top-k):
        ask for the routed experts too. `max_concurrency`: requests in flight over all servers
        (their max_running_requests, summed)."""
        self.client = engine.client(vocab_size, request_timeout_s=self.config.rollout.request_timeout_s,
                                    max_attempts=self.config.rollout.max_attempts, routing_shape=routing_shape,
                                    max_concurrency=max_concurrency)
        print(reproducibility(self.config), flush=True)

    def collect(self, step: int, weight_version: str | None = None,
                oldest_version: int | None = None) -> tuple[list[Rollout], list[float], dict]:
        """Rounds of generation until `rollout_batch_size` groups with signal are kept (at most
        `max_sampling_rounds`; each asks for `oversample` x the groups still missing). Metrics
        are over everything generated this step. `weight_version` (sync) / `oldest_version`
        (one_step_off): the versions the responses may come from."""
        rollouts, advantages, rounds = [], [], []
        for _ in range(self.config.rollout.max_sampling_rounds):
            missing = self.config.train.rollout_batch_size - sum(r["groups_kept"] for r in rounds)
            if missing <= 0:
                break
            kept, kept_advantages, figures = self.round(missing, math.ceil(missing * self.config.rollout.oversample),
                                                        weight_version, oldest_version)
            rollouts += kept
            advantages += kept_advantages
            rounds.append(figures)
        return rollouts, advantages, self.step_metrics(rounds)

    def draw(self, count: int) -> tuple[int, list]:
        """The next `count` prompts: (the first one's draw index, their dataset rows)."""
        with self.lock:  # the sampler's position
            first = self.draws()
            return first, [self.dataset[i] for i in self.sampler.next_indices(count)]

    def round(self, wanted: int, num_prompts: int, weight_version: str | None = None,
              oldest_version: int | None = None, drawn: tuple[int, list] | None = None) -> tuple[list, list, dict]:
        """One generation round: `num_prompts` groups (`drawn`: prompts `draw` gave already, or
        the next ones); keeps at most `wanted` of them, the first the group filter keeps.
        Thread-safe: the asynchronous producer runs one per group. Each response samples with
        the seed of its prompt's draw and its place in the group (gspo_mcore.common.seeds)."""
        cfg = self.config.train
        first, samples = drawn or self.draw(num_prompts)
        seeds = [rollout_seed(cfg.seed, first + i, k) for i in range(len(samples)) for k in range(cfg.group_size)]
        generated = self.generator.run(self.client, samples, cfg.group_size, self.sampling_params(), seeds,
                                       weight_version=weight_version, oldest_version=oldest_version)
        rollouts, texts, sizes, preset = generated.rollouts, generated.texts, generated.sizes, generated.preset
        answers = [s.answer for s, n in zip(samples, sizes) for _ in range(n)]
        group_ids = torch.arange(len(samples)).repeat_interleave(torch.tensor(sizes))
        reward = self.config.reward
        with self.lock:  # one reward runner; the running moments
            contexts = [s.reward_context() for s, n in zip(samples, sizes) for _ in range(n)]
            scores, stats = self.rewards.score(texts, answers, contexts, group_ids.tolist())
            self._check_rewards(stats, len(texts))
            # A function's own score (an environment's) replaces the reward function's.
            values = [s if p is None else p for s, p in zip(scores, preset)]
            # None: a response the reward could not score (reward.code.infrastructure_errors: mask):
            # dropped from its group here, before the advantages; it neither scores nor trains.
            judged = [i for i, value in enumerate(values) if value is not None]
            rewards = torch.tensor([values[i] for i in judged], dtype=torch.float32)
            group_ids = group_ids[judged]
            # reward.norm "batch" / "running": over this round's rewards / updated by each round.
            normed = adv.normalize_rewards(rewards, group_ids, reward.norm, self.running)
        advantages = adv.clip(adv.group_advantages(normed, group_ids, normalize_std=reward.advantage_std_norm),
                              reward.advantage_clip)
        keep = self.group_filter(rewards, group_ids)
        kept_groups = set(sorted(set(group_ids[keep].tolist()))[:wanted])  # the first ones with signal
        selected = [i for i, g in enumerate(group_ids.tolist()) if g in kept_groups]
        figures = {
            "rewards": rewards, "lengths": torch.tensor([len(r.response_ids) for r in rollouts], dtype=torch.float32),
            "truncated": sum(r.truncated for r in rollouts), "groups_kept": len(kept_groups),
            "groups_total": len(samples), "requests": len(rollouts),
            "reward_errors": stats.errors, "reward_timeouts": stats.timeouts, "reward_counts": stats.metrics,
            "trainable": sum(sum(r.mask) for r in rollouts), "turns": generated.infos,
        }
        kept = [dataclasses.replace(rollouts[judged[i]], reward=rewards[i].item(),
                                    reward_reason=stats.reasons.get(judged[i])) for i in selected]
        return kept, [advantages[i].item() for i in selected], figures

    def step_metrics(self, rounds: list[dict]) -> dict:
        """A step's rollout figures over its rounds; a step whose tool calls all failed (each
        raised or crashed its worker) stops the run as the user's error, quoting the first (it
        trained on nothing but error messages and looked like a run). Every failure is kept in
        `error_log`'s directory, tool_errors.log."""
        infos = [info for r in rounds for info in (r["turns"] or [])]
        failures = [message for info in infos for message in info.get("tool_failures", ())]
        if failures:
            kept = ""
            if self.error_log is not None:
                path = self.error_log.parent / "tool_errors.log"
                path.parent.mkdir(parents=True, exist_ok=True)
                with open(path, "a") as log:
                    log.writelines(message.replace("\n", " ") + "\n" for message in failures)
                kept = f"; all in {path}"
            runs = sum(info.get("tool_runs", 0) for info in infos)
            if len(failures) == runs:
                tools = ", ".join(self.config.rollout.tools)
                raise InputError(f"rollout.tools {tools}: all {runs} tool calls of this step failed; the first: "
                                 f"{failures[0]}{kept}")
        return round_metrics(rounds)

    def _check_rewards(self, stats, calls: int) -> None:
        """Failures are kept in `error_log`; too many stop the run as the user's error, quoting
        the first (a reward that raises on every call scored 0 silently and looked like a run)."""
        if not stats.messages:
            return
        reward = self.config.reward
        if self.error_log is not None:
            self.error_log.parent.mkdir(parents=True, exist_ok=True)
            with open(self.error_log, "a") as log:
                log.writelines(f"reward {reward.name}: {message}\n" for message in stats.messages)
        failed = stats.errors + stats.timeouts + stats.masked
        if failed == calls or failed > reward.max_error_fraction * calls:
            kept = f"; all in {self.error_log}" if self.error_log is not None else ""
            raise InputError(f"reward {reward.name}: {failed} of {calls} calls failed (reward.max_error_fraction "
                             f"{reward.max_error_fraction:g}); the first: {stats.messages[0]}{kept}")

    def draws(self) -> int:
        """Prompts drawn so far in the run, over its epochs: the next draw's index (a resumed
        run's sampler continues from the checkpoint's position, so its draws are numbered as the
        uninterrupted run's)."""
        state = self.sampler.state_dict()
        return state["epoch"] * state["num_samples"] + state["position"]

    def state_dict(self) -> dict:
        return {"sampler": self.sampler.state_dict(), "running": self.running.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])
        self.running.load_state_dict(state["running"])

    def close(self) -> None:
        # Under the lock: an asynchronous producer's group thread may be scoring (its close does not
        # wait for its threads); its reward workers were killed under it, their pipes closed while it
        # wrote (ValueError in close) and a new worker started for the dead one, left running.
        with self.lock:
            self.rewards.close()
        self.generator.close()


def round_metrics(rounds: list[dict]) -> dict:
    """A step's rollout figures over every round (or group) generated for it."""
    rewards = torch.cat([r["rewards"] for r in rounds])
    lengths = torch.cat([r["lengths"] for r in rounds])
    return {
        "reward_mean": rewards.mean().item(),
        "reward_std": rewards.std(unbiased=False).item(),
        "response_length_mean": lengths.mean().item(),
        "response_length_max": lengths.max().item(),
        "tokens_generated": int(lengths.sum().item()),
        "truncated_fraction": sum(r["truncated"] for r in rounds) / len(lengths),
        "groups_kept": sum(r["groups_kept"] for r in rounds),
        "groups_total": sum(r["groups_total"] for r in rounds),
        "sampling_rounds": len(rounds),
        "reward_errors": sum(r["reward_errors"] for r in rounds),
        "reward_timeouts": sum(r["reward_timeouts"] for r in rounds),
        "trainable_tokens": int(sum(r["trainable"] for r in rounds)),
        "env_token_fraction": 1.0 - sum(r["trainable"] for r in rounds) / max(1.0, lengths.sum().item()),
        **_turn_metrics([info for r in rounds for info in (r["turns"] or [])]),
        **step_figures(_summed([r.get("reward_counts") or {} for r in rounds])),
    }


def _summed(counts: list[dict]) -> dict:
    total: dict = {}
    for part in counts:
        for key, value in part.items():
            total[key] = total.get(key, 0) + value
    return total


def _turn_metrics(infos: list[dict]) -> dict:
    """Multi-turn functions' figures (null for the single-turn rollout)."""
    if not infos:
        return dict.fromkeys(("turns_mean", "tool_calls_mean", "tool_errors", "tool_timeouts"))
    return {"turns_mean": sum(i.get("turns", 0) for i in infos) / len(infos),
            "tool_calls_mean": sum(i.get("tool_calls", 0) for i in infos) / len(infos),
            "tool_errors": sum(i.get("tool_errors", 0) for i in infos),
            "tool_timeouts": sum(i.get("tool_timeouts", 0) for i in infos)}


def reproducibility(config: Config) -> str:
    """The line a run starts with: every request is seeded from train.seed (RolloutSource.round),
    and whether a rerun therefore samples the same tokens or what still moves them (measured on
    CPU, docs/09-reliability.md "Reproducible runs")."""
    rollout, why = config.rollout, []
    if rollout.mode != "sync":
        why.append(f"rollout.mode {rollout.mode}: which weights sample a token depends on timing")
    if config.distributed.device == "cuda":  # GPU kernels sum in an order that follows the batch's size
        if rollout.engine == "sglang" and "--enable-deterministic-inference" not in rollout.server_args:
            why.append("SGLang on GPU samples with the seeds, in batch-invariant kernels, only under "
                       "--enable-deterministic-inference (rollout.server_args)")
        if rollout.engine == "vllm" and os.environ.get("VLLM_BATCH_INVARIANT") != "1":
            why.append("vLLM on GPU: a request's logits move with the batch beside it unless VLLM_BATCH_INVARIANT=1")
    if rollout.urls:
        why.append("rollout.urls: servers this run did not start sample with the seeds only if started as a run "
                   "starts them (python -m gspo_mcore.engines.serve)")
    if rollout.tools:
        why.append("rollout.tools: a tool's results, timeouts included, are the tool's")
    said = "sampling: each request seeded from train.seed, its prompt's draw and its place in the group"
    if why:
        return f"{said}; a rerun may sample other tokens: {'; '.join(why)}"
    # Measured on CPU: SGLang's float32 log-probs moved up to ~1.4e-6 with the batch (its bfloat16
    # ones and vLLM's did not move).
    if rollout.engine == "sglang" and rollout.engine_dtype == "float32" and config.distributed.device == "cpu":
        return (f"{said}; a rerun samples the same tokens (bar a float32 near-tie: SGLang's logits move ~1e-6 "
                "with the batch)")
    return f"{said}; a rerun samples the same tokens"
