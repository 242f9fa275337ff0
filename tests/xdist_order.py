"""The order `make test`'s workers take work in: the heaviest xdist group first (longest
processing time first), then the ungrouped tests in collection order.

xdist's loadgroup queue is ordered by test count, which can leave a long group of few tests (the
3-test vllm_train group, ~300 s) to late in the tier, when the other workers may have nothing left.
Measured: the slow tier's wall was 34-121 s above its groups' sum / workers with this order, 56-81 s
with xdist's: within this machine's noise, so the gain is not shown. Seconds are a group's total on
this 2-core machine under the suite (the `time per xdist group` line the suite prints); only their
order matters, a group missing from them goes with the ungrouped tests (tests/test_test_layout.py
holds every group named here)."""

from __future__ import annotations

GROUP_SECONDS = {  # 2026-11-29, after the servers' and ranks' start-up cuts (90e18d3, ff6aae0)
    "train": 510, "vllm_train": 300, "bench": 290, "async_train": 235, "sglang_server": 215, "agent_cpu": 205,
    "layouts": 180, "code_cpu": 175, "bf16_server": 90, "vllm_engine": 65, "async_engine": 20,
}


def heaviest(scopes) -> str:
    """The scope to hand out next: the group of most seconds, else the first in queue order."""
    return max(scopes, key=lambda scope: GROUP_SECONDS.get(scope, 0))


def scheduler(config, log):
    """xdist's LoadGroupScheduling, taking the heaviest scope instead of the queue's first."""
    from xdist.scheduler import LoadGroupScheduling

    class HeaviestFirst(LoadGroupScheduling):
        def _assign_work_unit(self, node) -> None:
            # xdist pops the workqueue's first entry (an OrderedDict): put the heaviest there.
            self.workqueue.move_to_end(heaviest(self.workqueue), last=False)
            super()._assign_work_unit(node)

    return HeaviestFirst(config, log)
