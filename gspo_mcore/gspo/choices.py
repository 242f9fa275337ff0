"""The GSPO math's choices, as the types the config's fields use and as tuples for checks, without
torch: loading a config (and answering a typo in it) imports this, not the tensor functions."""

from __future__ import annotations

from typing import Literal, get_args

Level = Literal["sequence", "sequence_token", "token"]
Aggregation = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLEstimator = Literal["k1", "k2", "k3"]
MismatchCorrection = Literal["none", "token_tis", "sequence_mis"]
RewardNorm = Literal["none", "batch", "group", "running"]  # the config's reward.norm
LEVELS, AGGREGATIONS, KL_ESTIMATORS = get_args(Level), get_args(Aggregation), get_args(KLEstimator)
MISMATCH_CORRECTIONS, REWARD_NORMS = get_args(MismatchCorrection), get_args(RewardNorm)

# gspo_mcore.gspo.loss.LOSSES's names.
BUILT_IN_LOSSES = ("gspo", "gspo_token", "grpo", "sapo", "gmpo", "luspo", "cispo")
# The `loss` fields that only some built-ins read: the config refuses one set away from its default
# for another built-in (a `module:function` of yours may read any).
OWN_FIELDS = {"sapo": ("sapo_tau_pos", "sapo_tau_neg"), "gmpo": ("gmpo_log_clip",),
              "cispo": ("cispo_weight_max", "cispo_weight_min")}
CLIP_FIELDS = {name: ("clip_low", "clip_high", "dual_clip") for name in ("gspo", "gspo_token", "grpo", "luspo")}


def foreign_fields(function: str) -> dict[str, str]:
    """For a built-in `function`: each `loss` field it does not read -> why, in one line."""
    if function not in BUILT_IN_LOSSES:
        return {}
    readers: dict[str, list[str]] = {}
    for table in (OWN_FIELDS, CLIP_FIELDS):
        for loss_name, fields in table.items():
            for field in fields:
                readers.setdefault(field, []).append(loss_name)
    out = {field: f"applies to loss.function {', '.join(names)}, not {function}"
           for field, names in readers.items() if function not in names}
    if function == "luspo":
        out["aggregation"] = "luspo's length scaling is its aggregation (seq-mean-token-sum): leave it unset"
    return out
