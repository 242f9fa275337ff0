"""What a rollout function works with: its `Task` (a prompt row) and its `EngineHandle` (one
trajectory's way to the engine and the chat template), and the template arithmetic that splices
environment turns in by tokens (`environment_ids`). See gspo_mcore.rollout.functions."""

from __future__ import annotations

from dataclasses import dataclass, field

from gspo_mcore.common.errors import InputError, RequestRefused
from gspo_mcore.common.seeds import turn_seed
from gspo_mcore.batch.rollout import Rollout


@dataclass
class Task:
    """One prompt row: its chat `messages`, reference `answer`, the row's other fields (`extra`)."""
    messages: list[dict]
    answer: str
    extra: dict = field(default_factory=dict)


class EngineHandle:
    """What a rollout function gets for one trajectory (see the module docstring)."""

    def __init__(self, client, tokenizer, server: int, sampling: dict, seed: int | None, config=None,
                 weight_version: str | None = None, oldest_version: int | None = None, name: str = "", tools=None,
                 template_kwargs: dict | None = None, evaluation: bool = False):
        """`seed`: the trajectory's sampling seed, each turn's derived from it (None: the server
        draws); `config`: the run's RolloutConfig (max_turns, max_trajectory_tokens, ... for
        functions that read them); `template_kwargs`: data.chat_template_kwargs, for every rendering;
        `evaluation`: its requests go before training's waiting ones (the trainer waits on them)."""
        self.client, self.tokenizer, self.server, self.sampling = client, tokenizer, server, sampling
        self.config, self.template_kwargs = config, dict(template_kwargs or {})
        self.seed, self.weight_version, self.oldest_version, self.name = seed, weight_version, oldest_version, name
        self.tools = tools  # gspo_mcore.tools.runner.ToolRunner of rollout.tools (None without tools)
        self.calls, self.evaluation = 0, evaluation

    async def generate(self, input_ids: list[int], max_new_tokens: int | None = None) -> Rollout:
        """One model turn from `input_ids` (prompt + every token so far)."""
        params = dict(self.sampling)
        if self.seed is not None:
            params["sampling_seed"] = turn_seed(self.seed, self.calls)
        if max_new_tokens is not None:
            params["max_new_tokens"] = max_new_tokens
        self.calls += 1
        try:
            return await self.client.generate_one_async(f"{self.name}/turn-{self.calls}", list(input_ids), params,
                                                        self.server, self.weight_version, self.oldest_version,
                                                        evaluation=self.evaluation)
        except RequestRefused as err:  # the function asked for it: the user's error, not the engine's failure
            function = self.config.function if self.config is not None else "the rollout function"
            raise InputError(f"rollout.function {function}: the engine refused its request of {len(input_ids)} "
                             f"tokens with max_new_tokens {params.get('max_new_tokens')} ({err})") from None

    def chat_ids(self, messages: list[dict], **template_kwargs) -> list[int]:
        """The chat template's token ids for `messages`, the assistant turn opened (e.g.
        `tools=` the tools' JSON schemas)."""
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 **{**self.template_kwargs, **template_kwargs})
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def environment_ids(self, messages: list[dict], after: list[int]) -> list[int]:
        """The tokens the chat template puts after a model turn that ended with `after` (its
        tokens) for `messages` (tool results, a user's reply), through the next assistant
        turn's opening: the template's text for [a model turn, messages] past the model turn,
        less the end-of-turn marker when the model already wrote it."""
        return environment_ids(self.tokenizer, messages, after, **self.template_kwargs)


def environment_ids(tokenizer, messages: list[dict], after: list[int], **template_kwargs) -> list[int]:
    marker = "\u2063"  # an assistant turn whose content the template leaves as written
    base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": marker}]
    full = tokenizer.apply_chat_template(base + messages, tokenize=False, add_generation_prompt=True,
                                         **template_kwargs)
    if full.count(marker) != 1:
        raise InputError("rollout.function: the chat template does not render an assistant turn as written; "
                         "environment turns cannot be spliced in by tokens")
    text = full[full.index(marker) + len(marker):]
    eos = tokenizer.eos_token
    if eos and after and after[-1] == tokenizer.eos_token_id and text.lstrip(" ").startswith(eos):
        text = text.lstrip(" ")[len(eos):]  # the model wrote its end of turn itself
    return list(tokenizer.encode(text, add_special_tokens=False))
