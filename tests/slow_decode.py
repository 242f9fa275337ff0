"""A vLLM logits processor that slows decoding at no CPU cost: it sleeps at every sampling step
and leaves the logits as they are (argmax-invariant, so vLLM applies it after the temperature,
vllm/v1/sample/sampler.py; the processed log-probs are unchanged). A test's server loads it with
`--logits-processors tests.slow_decode:SlowDecode` (the server's PYTHONPATH holds the repository):
generation then takes a known minimum time however loaded the machine is, so a push is sure to
land while responses are generating. SLOW_DECODE_DELAY_S in the server's environment sets the
sleep (default 0.4 s)."""

import os
import time

from vllm.v1.sample.logits_processor import LogitsProcessor


class SlowDecode(LogitsProcessor):
    def __init__(self, vllm_config, device, is_pin_memory) -> None:
        self.delay_s = float(os.environ.get("SLOW_DECODE_DELAY_S", "0.4"))  # per decoding step of the batch

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update) -> None:
        pass

    def apply(self, logits):
        time.sleep(self.delay_s)
        return logits
