"""A training run: the command line and its start-up, the loop (`trainer`), its output directory
and the config saved there (what `--resume` may change), signals and preemption, metrics and
their schema, samples on disk, seeds, strict exactness, and the tools around a run (demo, plot,
torchrun)."""
