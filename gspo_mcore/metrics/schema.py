"""Every figure a run reports, in one table: what it is, how it is combined, where it shows.

Each row is one key of `metrics.jsonl` (and of TensorBoard and Weights & Biases). Everything
that lists metrics derives from this table: how the loss's per-microbatch figures combine over
microbatches and ranks (`combine_kinds`), which figures a step that trains nothing reports as
null (`UPDATE`), the progress line (`printed`) and the plots (`figure`). A figure is either
here and reported, or not computed; `metrics.RunLog` refuses a key that is not here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# How a per-microbatch figure of the loss combines over microbatches and data-parallel ranks
# (gspo_mcore.metrics.report.combine): "tokens" / "sequences" are means weighted by each part's
# `num_tokens` / `num_sequences` (or the row's own count, `counted_by`), "min" / "max" extremes
# over parts with sequences, "sum" totals.
# Combined this way they equal the figure of the whole minibatch exactly.
KINDS = ("sum", "tokens", "sequences", "min", "max")
# Which optimizer steps of a rollout batch a loss figure covers: "all" of them; "first" (theta =
# theta_old, so a ratio there is the train-inference mismatch alone); "per_step": the total over
# all steps divided by their number (the loss and the KL term, shares of each step's global loss).
SCOPES = ("all", "first", "per_step")


@dataclass(frozen=True)
class Metric:
    name: str
    doc: str
    kind: str | None = None  # set for the loss's own figures (gspo_mcore.gspo.loss / megatron_loss)
    scope: str = "all"
    update: bool = False  # a figure of the update: null in a step that trains nothing
    printed: str | None = None  # its fragment of the progress line, a format for the value
    printed_if_nonzero: bool = False  # printed only on a step where it is not 0 (a share of what went wrong)
    figure: str | None = None  # the plot it is drawn in (OUTPUT_DIR/plots/<figure>.png)
    label: str | None = None  # its axis label / legend entry there
    asynchronous: bool = False  # measured in rollout.mode one_step_off / async only: null in sync
    histogram: bool = False  # a list of counts per value 0, 1, ...: a histogram in TensorBoard / W&B
    counted_by: str | None = None  # the count a mean weighs by, an extreme is present with (default: kind's)

    @property
    def count(self) -> str:
        """The per-part count this figure combines by: its own, else num_tokens for a "tokens"
        mean and num_sequences for the rest."""
        return self.counted_by or ("num_tokens" if self.kind == "tokens" else "num_sequences")


def _loss(name, kind, doc, scope="all", **shown) -> Metric:
    return Metric(name, doc, kind=kind, scope=scope, update=True, **shown)


SCHEMA: tuple[Metric, ...] = (
    Metric("step", "optimizer updates done: the rollout batch just trained is this one"),
    # ---- the rollout batch (gspo_mcore.rollout.source)
    Metric("reward_mean", "mean reward of every response generated this step", printed="reward {:.3f}",
           figure="reward", label="mean reward"),
    Metric("reward_std", "reward standard deviation over the same responses", printed="±{:.3f}"),
    Metric("response_length_mean", "mean response length (tokens) of every response generated",
           printed="len {:.1f}", figure="response_length", label="mean response length (tokens)"),
    Metric("response_length_max", "longest response (tokens)"),
    Metric("truncated_fraction", "share of responses cut by a token budget: rollout.max_new_tokens, or a "
                                  "trajectory's rollout.max_trajectory_tokens", printed="truncated {:.0%}",
           printed_if_nonzero=True),
    Metric("groups_kept", "prompt groups trained on (dynamic sampling keeps those with signal)"),
    Metric("groups_total", "prompt groups generated, over every sampling round"),
    Metric("sampling_rounds", "generation rounds this step took to fill the batch"),
    Metric("trainable_tokens", "response tokens the loss trains on (the model's; a multi-turn trajectory's "
           "environment tokens are not)"),
    Metric("env_token_fraction", "share of the tokens after the prompt an environment inserted (multi-turn)"),
    Metric("turns_mean", "model turns per trajectory (multi-turn rollout functions; null otherwise)",
           printed="turns {:.1f}"),
    Metric("tool_calls_mean", "tool calls per trajectory (rollout.tools)"),
    Metric("tool_errors", "tool calls that raised, returned no text or were malformed", printed="tool errors {:.0f}"),
    Metric("tool_timeouts", "tool calls stopped at rollout.tool_timeout_s"),
    Metric("reward_errors", "responses whose reward raised (scored 0)"),
    Metric("reward_timeouts", "responses whose reward exceeded reward.timeout_s (scored 0)"),
    # ---- the code reward (gspo_mcore.rewards.code; null for other rewards)
    Metric("code_tests_run", "tests run in the sandbox this step (every round, hack checks included)"),
    Metric("code_sandbox_s", "seconds in the sandbox this step, summed over the reward workers"),
    Metric("code_tests_per_s", "tests per second of sandbox time (one worker's throughput)"),
    Metric("code_infrastructure_errors", "responses whose sandbox failed (never a pass: scored 0 or masked from the batch, as "
           "reward.code.infrastructure_errors says)"),
    Metric("code_timeouts", "tests stopped at their time limit"),
    Metric("code_no_program", "responses without a fenced code block (scored 0)"),
    Metric("code_no_program_fraction", "share of the step's scored responses without a program (a code score of 0 "
           "that is no program's verdict)", printed="no program {:.0%}", printed_if_nonzero=True),
    Metric("code_hack_rate", "of the responses checked (1/8 of those that pass their training subset), the share "
           "that fails another test; null when none was checked"),
    Metric("samples", "responses trained on this step"),
    Metric("tokens_generated", "response tokens generated for this step, every round, groups kept or not"),
    # ---- the loss's figures, combined exactly over microbatches and ranks
    _loss("loss", "sum", "the policy loss of loss.function (+ KL, - entropy bonus), mean over the step's optimizer "
          "steps", scope="per_step"),
    _loss("kl", "sum", "the KL term (before its coefficient), mean over optimizer steps; null when off",
          scope="per_step"),
    _loss("entropy", "tokens", "policy entropy per response token; null unless loss.log_entropy or entropy_coef"),
    _loss("num_tokens", "sum", "response tokens in the loss, summed over optimizer steps"),
    _loss("num_sequences", "sum", "sequences with response tokens in the loss, summed over optimizer steps"),
    _loss("clip_fraction", "tokens", "share of response tokens whose ratio the clip stopped (gmpo: its log-space "
          "token clip; cispo: whose importance weight was truncated, its gradient kept; sapo: null, no clip)",
          printed="clip {:.3f}",
          figure="clip_fraction", label="clipped share of response tokens"),
    _loss("clip_fraction_low", "tokens", "... below 1 - clip_low (negative advantage)"),
    _loss("clip_fraction_high", "tokens", "... above 1 + clip_high (positive advantage)"),
    _loss("clip_fraction_sequences", "sequences", "share of sequences clipped (loss.function gspo; null otherwise)"),
    _loss("ratio_mean", "sequences", "mean sequence ratio s_i (eq. 7) against pi_old"),
    _loss("ratio_min", "min", "smallest sequence ratio"),
    _loss("ratio_max", "max", "largest sequence ratio"),
    _loss("ratio_above_band", "sequences", "share of sequences with s_i > 1 + clip_high, whatever the advantage"),
    _loss("ratio_below_band", "sequences", "share of sequences with s_i < 1 - clip_low, whatever the advantage"),
    _loss("abs_log_ratio_mean", "sequences", "mean |log s_i| against pi_old over every minibatch"),
    _loss("abs_log_ratio_max", "max", "largest |log s_i|"),
    _loss("abs_log_ratio_token_mean", "tokens", "mean per-token |log pi_theta - log pi_old| (before length "
          "normalisation)"),
    _loss("token_mask_fraction", "tokens", "share of response tokens loss.token_mask_band masked; null when off"),
    _loss("sequence_mask_fraction", "sequences", "share of sequences loss.sequence_mask_threshold masked; null "
          "when off"),
    # The mismatch figures cover the tokens the current weights generated (every token in sync; in
    # the asynchronous modes an older version's tokens differ by the policy's own change too), so
    # they weigh by their own counts: null when a step has no such token, never diluted by zeros.
    _loss("mismatch_num_sequences", "sum", "sequences with tokens the current weights generated, first minibatch "
          "(every sequence in sync): what the mismatch figures are measured on", scope="first"),
    _loss("mismatch_num_tokens", "sum", "... their tokens", scope="first"),
    _loss("mismatch_abs_log_ratio_mean", "sequences", "train-inference mismatch: mean |log s_i| of the trainer "
          "against the engine's log-probs at theta = theta_old (first minibatch); null on a step with no token of "
          "the current weights in it (asynchronous modes: not printed then)", scope="first",
          printed="mismatch {:.1e}", figure="mismatch", label="mismatch |log s| (engine vs trainer)",
          counted_by="mismatch_num_sequences"),
    _loss("mismatch_abs_log_ratio_max", "max", "largest per-sequence mismatch there", scope="first",
          counted_by="mismatch_num_sequences"),
    Metric("exactness_abs_log_ratio_max", "train.strict_exactness: the largest per-sequence mismatch over the "
           "whole batch at theta_old (fresh tokens, float64 on the host; past train.strict_exactness_tolerance the "
           "run stops); null when the check is off", update=True),
    _loss("mismatch_token_abs_log_ratio_mean", "tokens", "per-token mismatch there", scope="first",
          counted_by="mismatch_num_tokens"),
    _loss("mismatch_kl", "tokens", "KL(pi_engine || pi_trainer) per response token there (k3 estimate on the "
          "engine's samples)", scope="first", counted_by="mismatch_num_tokens"),
    _loss("mismatch_out_of_band_fraction", "sequences", "share of sequences whose engine ratio is outside the "
          "configured clip band there", scope="first", counted_by="mismatch_num_sequences"),
    # loss.mismatch_correction's figures, from its weights pi_trainer(theta_old) / pi_engine (sync only).
    _loss("mismatch_weight_mean", "tokens", "mean importance weight of loss.mismatch_correction over response "
          "tokens, first minibatch; null when off", scope="first", counted_by="mismatch_num_tokens"),
    _loss("mismatch_truncated_fraction", "tokens", "token_tis: share of response tokens whose weight was truncated "
          "at loss.mismatch_threshold; null otherwise", scope="first", counted_by="mismatch_num_tokens"),
    _loss("mismatch_masked_fraction", "sequences", "sequence_mis: share of sequences masked (their ratio outside "
          "[1/C, C], C = loss.mismatch_threshold); null otherwise", scope="first",
          counted_by="mismatch_num_sequences"),
    _loss("behavior_weight_mean", "sequences", "asynchronous modes: mean per-sequence behaviour weight "
          "pi_prox / pi_engine over stale tokens (decoupled GSPO); null in sync"),
    _loss("behavior_weight_truncated_fraction", "sequences", "... share of sequences whose weight hit "
          "loss.behavior_weight_cap"),
    # ---- the update, beside the loss (gspo_mcore.megatron.learner)
    Metric("clip_band_high", "1 + this bounds the ratio in the minibatches after the first (loss.clip_high, or "
           "wider with loss.band_from_mismatch)", update=True, figure="mismatch", label="clip band (high)"),
    Metric("grad_norm", "gradient norm before clipping, mean over optimizer steps", update=True),
    Metric("minibatches", "optimizer steps per epoch on this batch", update=True),
    Metric("padding_fraction", "share of the update's input slots that held padding (rows padded to their "
           "microbatch's longest, to the TP multiple, filler microbatches): no expert computes them", update=True),
    Metric("lr", "learning rate", update=True),
    Metric("router_max_over_mean_load", "per MoE layer: max expert load / mean (1 = balanced)", update=True),
    Metric("routing_mismatch_fraction", "share of (token, MoE layer) pairs whose trainer top-k differs from the "
           "engine's, first minibatch, over the responses the engine routed with the trainer's weights (every "
           "one in sync; rollout.return_routed_experts; null otherwise or when none)", update=True),
    Metric("routing_mismatch_fraction_per_layer", "the same per MoE layer", update=True),
    Metric("routing_mismatch_fraction_older", "asynchronous modes: the same over the responses older weights "
           "routed (a response's routing is its last token's version: the engines re-prefill a continued request); "
           "the policy's change as well as the numerics; null in sync", update=True),
    Metric("routing_mb_per_rank_max", "MB of the engine's routed experts the busiest trainer rank received this "
           "step: each rank gets its own rollouts' rows for its own MoE layers (gspo_mcore.megatron.routing_delivery; "
           "rollout.return_routed_experts; null otherwise)"),
    # ---- asynchronous modes (gspo_mcore.rollout.producer); null in sync
    Metric("staleness_mean", "mean over trained responses of (the step's weight version - the response's oldest "
           "token's version)", printed="| stale {:.2f}", asynchronous=True, figure="staleness",
           label="staleness (versions), mean"),
    Metric("staleness_max", "the largest (bounded by rollout.max_staleness)", printed="max {:.0f}",
           asynchronous=True, figure="staleness", label="max"),
    Metric("staleness_bound", "rollout.max_staleness, the bound staleness_max keeps", printed="of {:.0f}",
           asynchronous=True),
    Metric("staleness_histogram", "trained responses per staleness 0, 1, ..., max_staleness", asynchronous=True,
           histogram=True),
    Metric("multi_version_fraction", "share of trained responses whose tokens span several weight versions",
           asynchronous=True),
    Metric("version_span_max", "the most weight versions one response spans", asynchronous=True),
    Metric("trainer_wait_s", "time the trainer waited for its batch", asynchronous=True),
    Metric("trainer_idle_fraction", "trainer_wait_s / time_step_s", printed="| trainer idle {:.2f}",
           asynchronous=True, figure="idle", label="trainer"),
    Metric("engine_idle_fraction", "1 - the servers' mean time with a request in flight (not paused) / wall time "
           "since the previous batch", printed="engine idle {:.2f}", figure="idle", label="engine"),
    Metric("tokens_regenerated", "tokens generated, then thrown away because a push aborted their request "
           "(rollout.partial: false; 0 otherwise)"),
    Metric("requests_retried", "generation requests that failed and were sent again (a timeout, a 5xx, a lost "
           "connection) since the previous batch: 0 when the servers run every request the client sends"),
    Metric("engine_pause_s", "time the servers were paused for the push (asynchronous modes)", asynchronous=True),
    Metric("samples_per_s", "responses trained per second of step"),
    # ---- the weight-sync check (steps where weight_sync.check_every fires)
    Metric("sync_check_median", "median |engine - trainer| log-prob over probe tokens, worst server"),
    Metric("sync_check_max", "largest difference there"),
    Metric("sync_check_within_0.1", "share of probe tokens within 0.1"),
    # ---- time
    Metric("time_rollout_s", "getting the step's batch: generation, rewards, advantages (asynchronous modes: the "
           "trainer's wait for a batch generated meanwhile)", printed="| batch {:.1f}s", figure="step_time",
           label="batch (sync: rollout; async: wait)"),
    Metric("time_train_s", "the updates (and any recomputed or reference log-probs)", printed="train {:.1f}s",
           figure="step_time", label="train"),
    Metric("time_sync_s", "the weight push (and the sync check)", printed="sync {:.1f}s", figure="step_time",
           label="sync"),
    Metric("time_step_s", "the whole step"),
    Metric("peak_memory_gb", "this step's peak over the trainer ranks: CUDA memory allocated (GiB), or the "
           "process's resident memory on CPU; compare with `python -m gspo_mcore.planner.cli`"),
    Metric("generated_tokens_per_s", "response tokens generated (every round, groups kept or not) per second of "
           "step", printed="| tok/s: generated {:.0f}"),
    Metric("trained_tokens_per_s", "prompt + response tokens trained per second of step", printed="trained {:.0f}"),
    # gspo_mcore.planner.flops: the one count the planner and the GPU check use too
    Metric("mfu", "model FLOPs utilisation of the training: the step's model FLOPs (6 x the active parameters less "
           "the input embedding + causal attention, a trained token an epoch; no recompute, no forward-only pass: "
           "the count of the published figures, Megatron-Bridge's 30% and NeMo Automodel's 28% for Qwen3-30B-A3B "
           "on H100) per second of time_train_s per trainer GPU over its dense bf16 peak; null on CPU and on a GPU "
           "without a known peak", update=True, printed="| mfu {:.2f}"),
    Metric("hfu", "hardware FLOPs utilisation: the same with what the GPUs run (model.recompute full's second "
           "forward, the fused log-probs' logits again in backward, the forward-only passes of the batch: pi_old / "
           "pi_prox, strict exactness, the KL reference)", update=True),
)

BY_NAME = {m.name: m for m in SCHEMA}
LOSS_METRICS = tuple(m for m in SCHEMA if m.kind is not None)
UPDATE = tuple(m.name for m in SCHEMA if m.update)
ASYNC_METRICS = tuple(m.name for m in SCHEMA if m.asynchronous)
HISTOGRAMS = tuple(m.name for m in SCHEMA if m.histogram)
FIGURES = {m.figure: tuple(n for n in SCHEMA if n.figure == m.figure) for m in SCHEMA if m.figure}


def combine_kinds() -> dict[str, tuple[str, str]]:
    """The loss figure name -> (its combination kind, the count it combines by)."""
    return {m.name: (m.kind, m.count) for m in LOSS_METRICS}


# One family of keys per evaluation dataset (gspo_mcore.evaluation.held_out): eval/<dataset>/mean@k,
# mean_se@k (its standard error over the prompts), prompts, pass@1..k, greedy, response_length, time_s,
# reward_errors (responses whose reward call failed, scored 0), truncated_fraction, no_program_fraction (a code
# reward's); in the rows of the steps evaluated, absent elsewhere.
EVAL_KEY = re.compile(r"^eval/[^/]+/(mean@\d+|mean_se@\d+|prompts|pass@\d+|greedy|response_length|time_s|reward_errors"
                      r"|truncated_fraction|no_program_fraction)$")


def unknown(keys) -> list[str]:
    """Keys that are not in the schema (per-layer lists are one key; eval/<dataset>/... a family)."""
    return sorted(k for k in keys if k not in BY_NAME and not EVAL_KEY.match(k))
