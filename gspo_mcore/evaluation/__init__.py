"""Held-out evaluation through the engine: during a run (`held_out`, config section `eval`) and
on its own (`gspo-eval`, `cli`)."""
