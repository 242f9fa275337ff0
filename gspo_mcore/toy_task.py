"""Deprecated: `gspo_mcore.toy_task` moved to `gspo_mcore.tasks.toy` (configs name e.g.
`gspo_mcore.tasks.toy:<function>`)."""

from gspo_mcore.common.deprecation import moved
from gspo_mcore.tasks.toy import *  # noqa: F401,F403 (the names configs gave as gspo_mcore.toy_task:<name>)

moved(__name__, "gspo_mcore.tasks.toy")
