"""The layout planner's model: `memory_model` (the layout check and memory per GPU by phase, which
the Trainer reports its measured peak against) and `costs` (disk, routed experts, FLOPs, a code
reward's CPU). `python -m gspo_mcore.planner.cli` is its command line."""
