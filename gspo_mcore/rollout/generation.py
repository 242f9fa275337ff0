"""Prompt rows -> responses, one path for training and evaluation: single-turn requests batched on
the engine, or the configured rollout function's trajectories (its tools, its turns, one tool
runner per run), each trajectory on its own server."""

from __future__ import annotations

from dataclasses import dataclass

from gspo_mcore.config import Config
from gspo_mcore.data import chat_prompt_ids
from gspo_mcore.rollout.engine_handle import EngineHandle, Task
from gspo_mcore.rollout.functions import load_rollout_function, run_functions
from gspo_mcore.tools.runner import ToolRunner
from gspo_mcore.batch.trajectory import to_rollout


@dataclass
class Generated:
    """What `Generator.run` returns, per response in prompt order (a prompt's responses together)."""
    texts: list[str]  # what the reward reads
    lengths: list[int]  # tokens after the prompt (an environment's included)
    sizes: list[int]  # responses per prompt row
    preset: list[float | None]  # a rollout function's own reward, or None: the reward function scores it
    rollouts: list | None = None  # the trainer's samples (None when not asked for: evaluation)
    infos: list[dict] | None = None  # per trajectory: its turns and tool figures (None: single turn)
    # Per trajectory, every token after the prompt decoded: the model's turns, the tool calls and
    # results between them (None: single turn, where the response is all of it).
    transcripts: list[str] | None = None
    truncated: list[bool] | None = None  # cut by a token budget (finish reason "length")


class Generator:
    """How a run turns prompt rows into responses (`rollout.function`, the chat template, the
    tools: the run's one tool runner, started here when the function calls tools)."""

    def __init__(self, config: Config, tokenizer):
        self.config, self.tokenizer = config, tokenizer
        self.function = load_rollout_function(config.rollout.function)
        self.tools = None
        if self.function is not None and config.rollout.tools:
            rollout = config.rollout
            self.tools = ToolRunner(rollout.tools, workers=rollout.tool_workers, timeout_s=rollout.tool_timeout_s)

    def run(self, client, samples: list, repeats: int, params: dict, seeds: list[int] | None = None, *,
            weight_version: str | None = None, oldest_version: int | None = None, evaluation: bool = False,
            name: str = "trajectory") -> Generated:
        """`repeats` responses to each of `samples` (dataset rows) through `client`. `seeds`: the
        sampling seed of each response, in prompt order (gspo_mcore.common.seeds; a function's
        trajectory seeds its turns from it); None: the servers draw. `weight_version` /
        `oldest_version`: what the responses' tokens may come from; `evaluation`: nobody trains
        on them (greedy allowed, no trainer samples built)."""
        if seeds is not None and len(seeds) != len(samples) * repeats:
            raise ValueError(f"{len(seeds)} seeds for {len(samples)} prompts x {repeats} responses")
        if self.function is None:
            return self._single_turn(client, samples, repeats, params, seeds, weight_version, oldest_version,
                                     evaluation)
        cfg, count = self.config, len(client.urls)

        def handle_for(i: int, k: int) -> EngineHandle:
            index = i * repeats + k  # spread over the servers; each trajectory stays on its own
            seed = None if seeds is None else seeds[index]
            return EngineHandle(client, self.tokenizer, index % count, params, seed, cfg.rollout, weight_version,
                                oldest_version, name=f"{name} {index}", tools=self.tools,
                                template_kwargs=cfg.data.chat_template_kwargs, evaluation=evaluation)

        tasks = [Task(s.messages, s.answer, dict(s.metadata)) for s in samples]
        groups = run_functions(self.function, tasks, repeats, handle_for, client.max_concurrency)
        flat = [t for group in groups for t in group]
        # turns: the model's, counted here (a user's function need not count them in its info)
        infos = [{**t.info, "turns": sum(s.trainable for s in t.segments)} for t in flat]
        transcripts = self.tokenizer.batch_decode([t.token_ids for t in flat], skip_special_tokens=False)
        return Generated([t.text for t in flat], [len(t.token_ids) for t in flat], [len(g) for g in groups],
                         [t.reward for t in flat],
                         None if evaluation else [to_rollout(t, f"{n}") for n, t in enumerate(flat)], infos,
                         transcripts, [t.finish_reason == "length" for t in flat])

    def _single_turn(self, client, samples, repeats, params, seeds, weight_version, oldest_version,
                     evaluation) -> Generated:
        template_kwargs = self.config.data.chat_template_kwargs
        prompts = [chat_prompt_ids(self.tokenizer, s.messages, template_kwargs) for s in samples]
        requests = [p for p in prompts for _ in range(repeats)]
        rollouts = client.generate(requests, params, weight_version=weight_version,
                                   seeds=seeds,
                                   oldest_version=oldest_version, evaluation=evaluation)
        texts = self.tokenizer.batch_decode([r.response_ids for r in rollouts], skip_special_tokens=True)
        return Generated(texts, [len(r.response_ids) for r in rollouts], [repeats] * len(samples),
                         [None] * len(rollouts), rollouts, truncated=[r.truncated for r in rollouts])

    def close(self) -> None:
        if self.tools is not None:
            self.tools.close()
