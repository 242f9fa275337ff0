"""The Megatron-Core side: process groups and parallel state, the learner (policy, reference,
DDP, optimizer), the loss inside Megatron's pipeline schedule, checkpoints, the CPU bridge that
runs megatron-core with gloo, routed-expert delivery, HF parity, and the model (`qwen3_moe`:
layer spec, forward, HF <-> Megatron weights, which the checkpoint converter shares)."""
