"""Loss functions named by import path (loss.function) in tests/test_loss.py."""

from gspo_mcore.gspo.loss import LossInputs, aggregate, gspo

CALLS: list[LossInputs] = []  # what each call of doubled_gspo got


def doubled_gspo(inputs: LossInputs, config):
    """A user's loss: the built-in GSPO, twice."""
    CALLS.append(inputs)
    loss, metrics = gspo(inputs, config)
    return 2 * loss, metrics


def reinforce(inputs: LossInputs, config):
    """A different loss written from the inputs alone: -A x log pi, unclipped, no metrics."""
    advantages = inputs.advantages if inputs.advantages.dim() == 2 else inputs.advantages[:, None]
    token_loss = -advantages * inputs.logprobs
    return aggregate(token_loss, inputs.mask, config.aggregation or "seq-mean-token-mean", inputs.normalizer), {}


def one_argument(inputs):
    return inputs.logprobs.sum(), {}


NOT_A_FUNCTION = 3
