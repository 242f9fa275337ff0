"""Tools for `rollout.tools` (module:function), written as Hugging Face tools are."""
