"""Deprecated: `gspo_mcore.agent_task` moved to `gspo_mcore.tasks.agent` (configs name e.g.
`gspo_mcore.tasks.agent:<function>`)."""

from gspo_mcore.common.deprecation import moved
from gspo_mcore.tasks.agent import *  # noqa: F401,F403 (the names configs gave as gspo_mcore.agent_task:<name>)

moved(__name__, "gspo_mcore.tasks.agent")
