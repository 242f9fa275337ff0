"""The loss path reads nothing back to the host per microbatch (on a GPU each read waits for every
queued kernel), and a non-finite pi_old still stops the step, before the update, naming its sample
and token. On CPU a TorchFunctionMode stands in for torch.cuda.set_sync_debug_mode: it records
every call that would read a device value on the host."""

import pytest
import torch
from torch.overrides import TorchFunctionMode

from gspo_mcore.config import LossConfig
from gspo_mcore.gspo.loss import LOSSES, deferred_input_checks

# Calls that copy a device value to the host (or wait for one): the scalar conversions, reads of
# data-dependent shapes, copies to the CPU.
READS = {"__bool__", "__int__", "__float__", "__index__", "__complex__", "item", "tolist", "numpy", "nonzero",
         "argwhere", "masked_select", "unique", "unique_consecutive", "equal", "allclose", "cpu"}


class HostReads(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        to_cpu = name in ("to", "copy_") and any(
            str(a) == "cpu" or (isinstance(a, torch.device) and a.type == "cpu") for a in (*args[1:], *kwargs.values()))
        boolean_index = name == "__getitem__" and isinstance(args[1], torch.Tensor) and args[1].dtype == torch.bool
        one_argument_where = name == "where" and len(args) + len(kwargs) == 1
        if name in READS or to_cpu or boolean_index or one_argument_where:
            self.seen.append(name)
        return func(*args, **kwargs)


def microbatch(seed: int, rows: list[int], vocab: int = 11, width: int = 7) -> tuple[dict, torch.Tensor]:
    """A microbatch as gspo_mcore.gspo.packing.microbatch_tensors lays it out, and its logits."""
    g = torch.Generator().manual_seed(seed)
    b = len(rows)
    lengths = torch.randint(1, width + 1, (b,), generator=g)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).float()
    mb = {"targets": torch.randint(0, vocab, (b, width), generator=g), "mask": mask,
          "old_logprobs": -torch.rand(b, width, generator=g) * 3, "advantages": torch.randn(b, generator=g),
          "ref_logprobs": -torch.rand(b, width, generator=g) * 3, "index": torch.tensor(rows),
          "sequences": torch.ones(b)}
    return mb, torch.randn(b, width, vocab, generator=g, requires_grad=True)


@pytest.fixture
def one_rank(monkeypatch):
    """Megatron's parallel state as one rank sees it alone (make_loss_func reads these two)."""
    from megatron.core import parallel_state

    monkeypatch.setattr(parallel_state, "get_data_parallel_world_size", lambda *a, **k: 1)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_group", lambda *a, **k: None)


def schedule(microbatches, cfg, *, on_policy=False):
    """What Megatron's schedule does with make_loss_func's loss_func: forward, then backward, per
    microbatch; the host reads it made."""
    from gspo_mcore.gspo.loss import Normalizer
    from gspo_mcore.megatron.pipeline_loss import make_loss_func

    normalizer = Normalizer(num_sequences=sum(float(mb["sequences"].sum()) for mb, _ in microbatches),
                            num_tokens=sum(float(mb["mask"].sum()) for mb, _ in microbatches), horizon=7.0)
    reads = HostReads()
    outputs = []
    with reads:
        for mb, logits in microbatches:
            loss_func = make_loss_func(mb, normalizer, cfg, 1.0, len(microbatches), band=(0.2, 0.3),
                                       on_policy=on_policy)
            loss, metrics = loss_func(logits)
            loss.backward()
            outputs.append(metrics)
    return reads.seen, outputs


@pytest.mark.parametrize("function", sorted(LOSSES))
def test_the_loss_path_reads_nothing_back_per_microbatch(one_rank, function):
    clip = {} if function in ("sapo", "gmpo", "cispo") else {"dual_clip": 3.0}
    cfg = LossConfig(function=function, kl_loss_coef=0.01, log_entropy=True, mismatch_correction="token_tis",
                     token_mask_band=[0.5, 2.0], **clip)
    microbatches = [microbatch(seed, rows) for seed, rows in enumerate([[0, 3], [1, 4, 5], [2]])]
    with deferred_input_checks() as checks:
        seen, outputs = schedule(microbatches, cfg)
        assert seen == [], f"host reads in the loss path: {seen}"
        assert len(checks.pending) == 3
        reads = HostReads()
        with reads:
            checks.raise_if_any()
        assert reads.seen == ["tolist"]  # every microbatch's flag in one read
    assert all(torch.isfinite(v).all() for out in outputs for v in out.values())


@pytest.mark.parametrize("on_policy", [False, True], ids=["engine-pi-old", "on-policy"])
def test_a_non_finite_old_logprob_stops_the_step_naming_its_sample_and_token(one_rank, on_policy):
    """The error names the rollout (the microbatch's `index`) and the token; only after the last
    microbatch. On-policy, pi_old is the forward's own log-probs: a non-finite logit there."""
    microbatches = [microbatch(seed, rows) for seed, rows in enumerate([[0, 3], [1, 4, 5], [2]])]
    mb, logits = microbatches[1]
    mb["mask"][2, :5] = 1.0
    if on_policy:
        with torch.no_grad():
            logits[2, 4, 0] = float("inf")  # log-softmax of an infinite logit: nan in every token of the row
    else:
        mb["old_logprobs"][2, 4] = float("nan")
    mb["old_logprobs"][0, 6] = float("inf")  # outside its sequence's response: not an error
    mb["mask"][0, 6] = 0.0
    with deferred_input_checks() as checks:
        seen, _ = schedule(microbatches, LossConfig(), on_policy=on_policy)  # no raise inside the schedule
        assert seen == []
        with pytest.raises(ValueError, match=r"^old_logprobs: non-finite value in sample 5 at token 4$"):
            checks.raise_if_any()


def test_without_a_deferral_the_loss_checks_at_once():
    """The pure functions keep their contract (tests/test_loss.py): the error at the call."""
    from gspo_mcore.gspo.loss import policy_loss

    old = torch.zeros(2, 3)
    old[1, 2] = float("-inf")
    with pytest.raises(ValueError, match="old_logprobs: non-finite value in sample 1 at token 2"):
        policy_loss(torch.zeros(2, 3), old, torch.ones(2), torch.ones(2, 3))


def test_the_optimizer_step_reads_the_checks_before_the_update(monkeypatch, one_rank):
    """gspo_mcore.megatron.optimizer.optimizer_step: the schedule's microbatches under the deferral,
    one read after the last, and no optimizer step when one is bad."""
    from gspo_mcore.gspo.loss import Normalizer
    from gspo_mcore.megatron import optimizer as optimizer_module
    from gspo_mcore.megatron.pipeline_loss import make_loss_func

    microbatches = [microbatch(seed, rows) for seed, rows in enumerate([[0, 1], [2, 3]])]
    logits = {id(mb): x for mb, x in microbatches}
    reads = HostReads()

    def run_schedule(ddp, mbs, loss_for, **kwargs):
        with reads:
            outs = []
            for mb in mbs:
                loss, metrics = loss_for(mb)(logits[id(mb)])
                loss.backward()
                outs.append(metrics)
        return outs

    class Optimizer:
        steps = 0

        def zero_grad(self):
            pass

        def step(self):
            Optimizer.steps += 1
            return True, torch.tensor(1.0), None

    class DDP:
        def zero_grad_buffer(self):
            pass

    monkeypatch.setattr(optimizer_module, "run_schedule", run_schedule)
    normalizer = Normalizer(num_sequences=4.0, num_tokens=sum(float(mb["mask"].sum()) for mb, _ in microbatches))

    def loss_for(mb):
        return make_loss_func(mb, normalizer, LossConfig(), 1.0, 2)

    mbs = [mb for mb, _ in microbatches]
    optimizer_module.optimizer_step(DDP(), Optimizer(), mbs, loss_for)
    assert Optimizer.steps == 1 and reads.seen == []
    mbs[0]["old_logprobs"][1, 0] = float("nan")
    with pytest.raises(ValueError, match="old_logprobs: non-finite value in sample 1 at token 0"):
        optimizer_module.optimizer_step(DDP(), Optimizer(), mbs, loss_for)
    assert Optimizer.steps == 1 and reads.seen == []
