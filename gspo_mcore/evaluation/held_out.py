"""Held-out evaluation through the engine (config section `eval`): each dataset's prompts through
the training chat template, `samples` responses each, scored by the dataset's reward in worker
processes. With a `rollout.function` (a tool loop, a user's multi-turn function) each sample is
one call of that function, as in training (its tools, its turns), scored by its trajectory's
text (or the function's own reward). Per dataset `eval/<name>/`: `mean@k` (mean reward over the k samples of every
prompt) and `mean_se@k` (its standard error over the prompts), `prompts`, `pass@j` for j = 1..k (Chen et al. 2021's unbiased estimator over the prompts: the
chance that at least one of j samples is correct, a response being correct when its reward is
>= 1; pass@1 is then the mean over the k samples of each prompt, as code benchmarks report it),
`greedy` (accuracy at temperature 0), `response_length`, `time_s`, `reward_errors`,
`truncated_fraction` (responses cut by max_new_tokens) and, for a code reward, `no_program_fraction`
(responses with no program to run): gspo-eval's table shows these two when they are not 0.

Each dataset's reward is built as training builds its own (RewardRunner.from_config): the
training reward with its `reward.batched` / `reward.url`, another one per response, reward.code's
settings in every worker, the dataset's answers read by the reward before any server starts. A
call that fails (raises, times out, cannot score a response) scores 0 and is never silent: counted
in `reward_errors`, said on stderr with the first failure, and an evaluation where every call
failed stops with it (its zeros would measure the reward, not the model).
"""

from __future__ import annotations

import math
import sys
import time

from gspo_mcore.config import Config
from gspo_mcore.data import PromptDataset
from gspo_mcore.common.errors import InputError
from gspo_mcore.common.seeds import eval_seed
from gspo_mcore.rewards.runner import RewardRunner
from gspo_mcore.rollout.generation import Generator

CORRECT = 1.0 - 1e-6  # a reward this high counts as a correct answer for pass@k


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n - c, k) / C(n, k): at least one correct among k of n samples, c correct, drawn
    without replacement (the product form avoids the binomials' overflow)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def dataset_metrics(name: str, rewards: list[list[float]], lengths: list[int], greedy: bool, seconds: float,
                    reward_errors: int = 0, truncated: int = 0, no_program: int | None = None) -> dict:
    """eval/<name>/... from each prompt's sample rewards; `reward_errors`: responses whose reward
    call failed (scored 0); `truncated`: responses cut by max_new_tokens; `no_program`: responses
    with no program to run (a code reward's count; None: the reward does not count them)."""
    k = len(rewards[0])
    flat = [r for prompt in rewards for r in prompt]
    means = [sum(prompt) / k for prompt in rewards]
    mean = sum(means) / len(means)
    # The standard error of mean@k over the prompts (their means' spread / sqrt(prompts)).
    spread = (sum((m - mean) ** 2 for m in means) / (len(means) - 1)) ** 0.5 if len(means) > 1 else 0.0
    out = {f"eval/{name}/mean@{k}": sum(flat) / len(flat), f"eval/{name}/mean_se@{k}": spread / len(means) ** 0.5,
           f"eval/{name}/prompts": len(rewards),
           f"eval/{name}/response_length": sum(lengths) / len(lengths), f"eval/{name}/time_s": seconds,
           f"eval/{name}/reward_errors": reward_errors, f"eval/{name}/truncated_fraction": truncated / len(flat)}
    if no_program is not None:
        out[f"eval/{name}/no_program_fraction"] = no_program / len(flat)
    correct = [sum(r >= CORRECT for r in prompt) for prompt in rewards]
    for j in range(1, k + 1):
        out[f"eval/{name}/pass@{j}"] = sum(pass_at_k(k, c, j) for c in correct) / len(correct)
    if greedy:
        out[f"eval/{name}/greedy"] = sum(c > 0 for c in correct) / len(correct)
    return out


def report_reward_failures(name: str, reward: str, stats, responses: int) -> int:
    """How many of a dataset's `responses` the reward failed on (raised, timed out, returned None:
    each scored 0), said on stderr with the first failure; every one failing is an InputError."""
    failed = stats.errors + stats.timeouts + stats.masked
    if not failed:
        return 0
    said = (f"eval dataset {name}: reward {reward}: {failed} of {responses} responses not scored (each "
            f"scored 0); the first: {stats.messages[0]}")
    if failed == responses:
        raise InputError(said.replace("(each scored 0)", "(all of them: the evaluation would measure the reward, "
                                      "not the model)"))
    print(said, file=sys.stderr, flush=True)
    return failed


class Evaluator:
    """The config's eval datasets, loaded (and their rewards started) once; `run(client)` per
    evaluation. Rank 0 only."""

    def __init__(self, config: Config, tokenizer, generator: Generator | None = None):
        """`generator`: the training run's (its tool runner); None: one of its own (gspo-eval)."""
        self.config, self.tokenizer = config, tokenizer
        data, reward = config.data, config.reward
        self.datasets = []
        for d in config.eval.datasets:
            dataset = PromptDataset.load(d.path, data.prompt_key, data.messages_key, data.answer_key)
            samples = [dataset[i] for i in range(min(len(dataset), d.max_prompts or len(dataset)))]
            # As training builds its own (batched, url, reward.code); a masked response scores 0 here.
            runner = RewardRunner.from_config(reward, d.reward or None, samples, evaluation=True)
            self.datasets.append((d, samples, runner))
        self.owns_generator = generator is None
        self.generator = generator or Generator(config, tokenizer)
        self.last_samples: list[dict] = []  # a few of the last evaluation's responses, for OUTPUT_DIR/samples

    def run(self, client, version: str | None = None, keep_samples: int = 4, seeded_as: str | None = None) -> dict:
        """Every dataset once against `client`'s servers; `version`: the weight version every
        response must come from (the one just pushed), and the seeds' unless `seeded_as` names
        another (gspo-eval: the run's version of the weights it serves, to repeat its evaluation)."""
        metrics, self.last_samples = {}, []
        for d, samples, runner in self.datasets:
            began = time.monotonic()
            params = {"max_new_tokens": d.max_new_tokens, "temperature": d.temperature}
            # Seeded by (run seed, dataset, weights, prompt, sample): a rerun evaluates alike.
            seeds = [eval_seed(self.config.train.seed, d.name, seeded_as or version, i, k)
                     for i in range(len(samples)) for k in range(d.samples)]
            generated = self.generator.run(client, samples, d.samples, params, seeds, weight_version=version,
                                           evaluation=True, name=f"eval {d.name}")
            wrong = [size for size in generated.sizes if size != d.samples]
            if wrong:  # pass@k needs k answers per prompt
                raise InputError(f"rollout.function {self.config.rollout.function}: returned "
                                 f"{wrong[0]} trajectories for {d.samples} calls on eval dataset {d.name}; "
                                 "evaluation scores one per call")
            texts, lengths, preset = generated.texts, generated.lengths, generated.preset
            repeated = [s for s in samples for _ in range(d.samples)]
            groups = [i for i in range(len(samples)) for _ in range(d.samples)]
            scores, stats = runner.score(texts, [s.answer for s in repeated], [s.reward_context() for s in repeated],
                                         groups)
            failed = report_reward_failures(d.name, runner.reward_name, stats, len(texts))
            scores = [s if p is None else p for s, p in zip(scores, preset)]  # a function's own reward first
            per_prompt = [scores[i * d.samples:(i + 1) * d.samples] for i in range(len(samples))]
            metrics.update(dataset_metrics(d.name, per_prompt, lengths, d.temperature == 0,
                                           time.monotonic() - began, failed, sum(generated.truncated or ()),
                                           stats.metrics.get("code_no_program")))
            self.last_samples += [{"eval": d.name, "prompt": repeated[i].prompt, "response": texts[i],
                                   "reward": scores[i], "answer": repeated[i].answer,
                                   **({"reason": stats.reasons[i]} if i in stats.reasons and preset[i] is None
                                      else {}),
                                   **({"transcript": generated.transcripts[i]} if generated.transcripts else {})}
                                  for i in range(min(keep_samples, len(texts)))]
        return metrics

    def close(self) -> None:
        for _, _, runner in self.datasets:
            runner.close()
        if self.owns_generator:
            self.generator.close()
