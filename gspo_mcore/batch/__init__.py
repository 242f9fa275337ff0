"""What a step trains on, whatever the engine and rollout function: a `Rollout` per response,
a `Batch` of them, and the multi-turn `Trajectory` that becomes a Rollout. Engines and rollout
functions produce these; the learner, packing and metrics consume them; this package imports
neither side."""
