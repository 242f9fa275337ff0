"""An optimizer's step taken over each param group a chunk at a time: what bounds the transient of an
optimizer that copies a whole group for its step (Transformer Engine's FusedAdam with bf16
moments). No torch or megatron here: the planner reads STEP_CHUNK_PARAMS."""

from __future__ import annotations

from gspo_mcore.config import ConfigError

# Transformer Engine's FusedAdam with bf16 moments holds an fp32 copy of both moments of every
# parameter of the group it steps until the group's kernel ran (fused_adam.py `step`:
# get_unscaled_state -> unscaled_lists, scaled back after the group): 8 bytes a parameter of the
# group, 27 GiB for the 30B config's expert group at EP 8 (3.6B parameters, no expert-DP to shard
# them), more than the activations. Stepped 256M parameters at a time, it is 2 GiB.
STEP_CHUNK_PARAMS = 256 * 2**20


def step_groups_in_chunks(inner, chunk_params: int) -> None:
    """`inner.step` (an optimizer whose step runs over `self.param_groups` and keeps a per-group
    `step` count: TE's FusedAdam) made to step each group `chunk_params` parameters at a time, as
    groups of their own with the group's settings and its count: the same update tensor by tensor
    (the kernels are elementwise; the bias correction reads the group's count, the same for every
    chunk), with the transient of one chunk. Refused for a capturable optimizer (its count is a
    device tensor each chunk would add to)."""
    if getattr(inner, "capturable", False):
        raise ConfigError("optimizer.precision_aware: a capturable FusedAdam cannot be stepped in chunks")
    whole_step = inner.step

    def step(closure=None, **kwargs):
        loss = closure() if closure is not None else None
        groups = inner.param_groups
        try:
            for group in groups:
                count, stepped = group.get("step"), None
                for chunk in _chunks(group["params"], chunk_params):
                    part = {**group, "params": chunk}
                    if count is None:
                        part.pop("step", None)
                    inner.param_groups = [part]
                    whole_step(**kwargs)
                    stepped = part.get("step", stepped)
                if stepped is not None:
                    group["step"] = stepped
        finally:
            inner.param_groups = groups
        return loss

    inner.step = step


def _chunks(params: list, limit: int) -> list[list]:
    """`params` in order, cut into runs of at most `limit` elements (a larger tensor alone)."""
    out, run, size = [], [], 0
    for p in params:
        if run and size + p.numel() > limit:
            out.append(run)
            run, size = [], 0
        run.append(p)
        size += p.numel()
    return out + [run] if run else out
