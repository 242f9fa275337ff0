"""Every figure a run reports: the schema (one row per metric: what it is, how it is combined,
where it shows) and the report (the loss's metrics combined exactly over microbatches and ranks,
the sinks: metrics.jsonl, TensorBoard, Weights & Biases, and the progress line)."""
