"""The layout planner's model: `memory_model` (the layout check and memory per GPU by phase, which
the Trainer reports its measured peak against), `costs` (disk, routed experts, a step's FLOPs, a
code reward's CPU) and `flops` (model and hardware FLOPs, the one count behind every MFU and HFU).
`python -m gspo_mcore.planner.cli` is its command line."""
