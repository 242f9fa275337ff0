"""Held-out evaluation through the engine (config section `eval`): each dataset's prompts through
the training chat template, `samples` responses each, scored by the dataset's reward in worker
processes. With a `rollout.function` (a tool loop, a user's multi-turn function) each sample is
one call of that function, as in training (its tools, its turns), scored by its trajectory's
text (or the function's own reward). Per dataset `eval/<name>/`: `mean@k` (mean reward over the k samples of every
prompt), `pass@j` for j = 1..k (Chen et al. 2021's unbiased estimator over the prompts: the
chance that at least one of j samples is correct, a response being correct when its reward is
>= 1), `greedy` (accuracy at temperature 0), `response_length`, `time_s`.
"""

from __future__ import annotations

import math
import time

from gspo_mcore.config import Config
from gspo_mcore.data import PromptDataset, chat_prompt_ids
from gspo_mcore.errors import InputError
from gspo_mcore.rewards.runner import RewardRunner
from gspo_mcore.rollout.engine_handle import EngineHandle, Task
from gspo_mcore.rollout.functions import load_rollout_function, run_functions

CORRECT = 1.0 - 1e-6  # a reward this high counts as a correct answer for pass@k


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n - c, k) / C(n, k): at least one correct among k of n samples, c correct, drawn
    without replacement (the product form avoids the binomials' overflow)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def dataset_metrics(name: str, rewards: list[list[float]], lengths: list[int], greedy: bool, seconds: float) -> dict:
    """eval/<name>/... from each prompt's sample rewards."""
    k = len(rewards[0])
    flat = [r for prompt in rewards for r in prompt]
    out = {f"eval/{name}/mean@{k}": sum(flat) / len(flat),
           f"eval/{name}/response_length": sum(lengths) / len(lengths), f"eval/{name}/time_s": seconds}
    correct = [sum(r >= CORRECT for r in prompt) for prompt in rewards]
    for j in range(1, k + 1):
        out[f"eval/{name}/pass@{j}"] = sum(pass_at_k(k, c, j) for c in correct) / len(correct)
    if greedy:
        out[f"eval/{name}/greedy"] = sum(c > 0 for c in correct) / len(correct)
    return out


class Evaluator:
    """The config's eval datasets, loaded (and their rewards started) once; `run(client)` per
    evaluation. Rank 0 only."""

    def __init__(self, config: Config, tokenizer):
        self.config, self.tokenizer = config, tokenizer
        data, reward = config.data, config.reward
        self.datasets = []
        for d in config.eval.datasets:
            dataset = PromptDataset.load(d.path, data.prompt_key, data.messages_key, data.answer_key)
            samples = [dataset[i] for i in range(min(len(dataset), d.max_prompts or len(dataset)))]
            runner = RewardRunner(d.reward or reward.name, reward.timeout_s, reward.workers)
            self.datasets.append((d, samples, runner))
        self.function = load_rollout_function(config.rollout.function)
        self.tools = None
        if self.function is not None and config.rollout.tools:
            from gspo_mcore.tools.runner import ToolRunner

            self.tools = ToolRunner(config.rollout.tools, workers=config.rollout.tool_workers,
                                    timeout_s=config.rollout.tool_timeout_s)
        self.last_samples: list[dict] = []  # a few of the last evaluation's responses, for OUTPUT_DIR/samples

    def run(self, client, version: str | None = None, keep_samples: int = 4) -> dict:
        """Every dataset once against `client`'s servers; `version`: the weight version every
        response must come from (the one just pushed)."""
        metrics, self.last_samples = {}, []
        for d, samples, runner in self.datasets:
            began = time.monotonic()
            params = {"max_new_tokens": d.max_new_tokens, "temperature": d.temperature}
            if self.function is None:
                prompts = [chat_prompt_ids(self.tokenizer, s.messages, self.config.data.chat_template_kwargs)
                           for s in samples]
                requests = [p for p in prompts for _ in range(d.samples)]
                rollouts = client.generate(requests, params, weight_version=version,
                                           seeds=list(range(len(requests))), evaluation=True)
                texts = self.tokenizer.batch_decode([r.response_ids for r in rollouts], skip_special_tokens=True)
                lengths, preset = [len(r.response_ids) for r in rollouts], [None] * len(rollouts)
            else:
                texts, lengths, preset = self._trajectories(client, d.name, samples, d.samples, params, version)
            repeated = [s for s in samples for _ in range(d.samples)]
            groups = [i for i in range(len(samples)) for _ in range(d.samples)]
            scores, _ = runner.score(texts, [s.answer for s in repeated], [s.reward_context() for s in repeated], groups)
            scores = [s if p is None else p for s, p in zip(scores, preset)]  # a function's own reward first
            per_prompt = [scores[i * d.samples:(i + 1) * d.samples] for i in range(len(samples))]
            metrics.update(dataset_metrics(d.name, per_prompt, lengths, d.temperature == 0,
                                           time.monotonic() - began))
            self.last_samples += [{"eval": d.name, "prompt": repeated[i].prompt, "response": texts[i],
                                   "reward": scores[i], "answer": repeated[i].answer}
                                  for i in range(min(keep_samples, len(texts)))]
        return metrics

    def _trajectories(self, client, name: str, samples, repeats: int, params: dict, version: str | None):
        """The rollout function `repeats` times per sample, as training calls it (one server per
        trajectory, the run's tools): the texts to score, the tokens after each prompt (the
        environment's included), the functions' own rewards."""
        rollout, count = self.config.rollout, len(client.urls)

        def handle_for(i: int, k: int) -> EngineHandle:
            index = i * repeats + k
            return EngineHandle(client, self.tokenizer, index % count, params, index * 1_000, rollout, version,
                                name=f"eval {name} {index}", tools=self.tools,
                                template_kwargs=self.config.data.chat_template_kwargs)

        tasks = [Task(s.messages, s.answer, dict(s.metadata)) for s in samples]
        groups = run_functions(self.function, tasks, repeats, handle_for, client.max_concurrency)
        for group in groups:
            if len(group) != repeats:  # pass@k needs k answers per prompt
                raise InputError(f"rollout.function {rollout.function}: returned {len(group)} trajectories for "
                                 f"{repeats} calls on eval dataset {name}; evaluation scores one per call")
        flat = [t for group in groups for t in group]
        return ([t.text for t in flat], [len(t.token_ids) for t in flat], [t.reward for t in flat])

    def close(self) -> None:
        for _, _, runner in self.datasets:
            runner.close()
        if self.tools is not None:
            self.tools.close()
