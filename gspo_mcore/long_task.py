"""Deprecated: `gspo_mcore.long_task` moved to `gspo_mcore.tasks.long` (configs name e.g.
`gspo_mcore.tasks.long:<function>`)."""

from gspo_mcore.common.deprecation import moved
from gspo_mcore.tasks.long import *  # noqa: F401,F403 (the names configs gave as gspo_mcore.long_task:<name>)

moved(__name__, "gspo_mcore.tasks.long")
