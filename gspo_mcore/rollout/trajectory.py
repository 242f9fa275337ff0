"""Deprecated: `gspo_mcore.rollout.trajectory` moved; rollout functions import from `gspo_mcore.api`."""

from gspo_mcore.common.deprecation import moved
from gspo_mcore.batch.trajectory import Segment, Trajectory, to_rollout

__all__ = ["Segment", "Trajectory", "to_rollout"]

moved(__name__, "from gspo_mcore.api import Trajectory")
