"""Deprecated: `gspo_mcore.code_task` moved to `gspo_mcore.tasks.code` (configs name e.g.
`gspo_mcore.tasks.code:<function>`)."""

from gspo_mcore.common.deprecation import moved
from gspo_mcore.tasks.code import *  # noqa: F401,F403 (the names configs gave as gspo_mcore.code_task:<name>)

moved(__name__, "gspo_mcore.tasks.code")
