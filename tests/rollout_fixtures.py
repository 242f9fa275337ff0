"""A user's rollout function, importable by name from a run's own process (it imports nothing from
the tests: `rollout.function=tests.rollout_fixtures:three_turns`)."""

from gspo_mcore.api import Trajectory


async def three_turns(task, engine):
    """A user-written rollout function: three model turns, a user message spliced in by tokens
    between them (runs name it: tests.rollout_fixtures:three_turns)."""
    prompt = engine.chat_ids(task.messages)
    trajectory = Trajectory(prompt_ids=prompt)
    for turn in range(3):
        reply = await engine.generate(prompt + trajectory.token_ids, max_new_tokens=5)
        trajectory.add_model(reply)
        if turn < 2:
            message = {"role": "user", "content": f"name a {('fruit', 'number')[turn]}"}
            trajectory.add_environment(engine.environment_ids([message], reply.response_ids))
    trajectory.text = engine.tokenizer.decode(reply.response_ids, skip_special_tokens=True)
    return trajectory
