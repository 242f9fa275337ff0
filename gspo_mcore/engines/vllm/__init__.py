"""vLLM behind the `Engine` interface (rollout.engine: vllm): its OpenAI-compatible server with the
dev-mode RL routes, driven over HTTP only, no patch to vLLM's source (gspo_mcore/engines/vllm/engine.py)."""
