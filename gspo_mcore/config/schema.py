"""The run configuration's schema: one dataclass per section, each field with its type, default
and doc string (docs/config_reference.md and `gspo-train --help-config` are generated from them),
and each section's own checks (`check`) beside its fields. Checks that read several sections are
gspo_mcore.config.validate's; reading YAML and overrides is gspo_mcore.config.load's.

A field a `--resume` may change carries `metadata=RESUME` (the learning rate and its schedule, the
step count, the save cadence, where the servers are, timeouts): `resume_fields()` lists them for
gspo_mcore.run.saved_config; any other field changes the model or the data order and refuses a resume.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Literal, get_type_hints

from gspo_mcore.gspo.choices import Aggregation, KLEstimator, MismatchCorrection, RewardNorm, foreign_fields
from gspo_mcore.config.validate import ConfigError, validate
from gspo_mcore.rewards.code_config import CodeRewardConfig

RESUME = {"resume": True}  # field metadata: `--resume` applies a new value of this field


def _at_least(section, prefix: str, names: tuple[str, ...], bound: int) -> None:
    for name in names:
        if getattr(section, name) < bound:
            raise ConfigError(f"{prefix}.{name}: must be >= {bound}")


@dataclass
class ModelConfig:
    hf_dir: str = ""
    """Hugging Face checkpoint directory (config.json + safetensors) of a Qwen3-MoE model."""
    mcore_dir: str | None = None
    """Initial weights from this torch_dist checkpoint (`checkpoint_convert hf-to-mcore`) instead
    of hf_dir's safetensors; hf_dir still gives the config and tokenizer."""
    spec: Literal["local", "te", "torch"] = "local"
    """Module set, all three reading and writing the same checkpoints: `local` = megatron-core's
    local modules, torch SDPA attention, the experts one GEMM after another (CPU, any GPU); `te` =
    Transformer Engine, grouped GEMM (GPU image only); `torch` = `local` with each expert GEMM of a
    layer done as one grouped GEMM (torch._grouped_mm: bf16 on sm90/sm100 GPUs, refused on other
    GPUs; float32 and CPU run an exact per-expert loop), nothing beyond PyTorch and megatron-core."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter and compute dtype."""
    recompute: Literal["none", "full"] = "none"
    """Activation recompute: `full` keeps each layer's input only and recomputes the layer
    in backward (about 1/3 more compute, far less activation memory)."""
    moe_aux_loss_coeff: float = 0.0
    """Load-balancing aux loss. Off by default: in RL the router follows the policy gradient only."""
    fused_logprobs: bool = field(default=True, metadata=RESUME)
    """The output layer and the log-probs computed together a block of the vocabulary at a time
    (forward and backward, the block's logits computed again in backward): the [tokens,
    vocabulary] logits and their gradient never exist (at Qwen3's 151,936 words and 16k tokens,
    two 4.6 GiB bf16 tensors). The same log-probs, entropy and gradients as the logits path to
    float32 rounding; `false`: the logits path."""


@dataclass
class DistributedConfig:
    device: Literal["cpu", "cuda"] = "cpu"
    """cpu: gloo + the megatron-core CPU bridge; cuda: NCCL. Chosen here, never guessed."""
    tensor_parallel: int = 1
    """TP size; sequence parallelism is always on when TP > 1 (Megatron requires it for MoE)."""
    pipeline_parallel: int = 1
    """PP size: pipeline stages, each a contiguous run of layers."""
    expert_parallel: int = 1
    """EP size: each MoE layer's experts split over this many ranks."""
    expert_tensor_parallel: int = 1
    """TP size inside each expert (1 = experts unsplit, the usual choice for fine-grained MoE)."""
    timeout_minutes: float = field(default=30.0, metadata=RESUME)
    """The trainer's collectives: a rank that waits longer than this for its peers fails the run."""
    rollout_timeout_minutes: float = field(default=240.0, metadata=RESUME)
    """How long the other ranks wait, on the host, for rank 0's rollout batch (generation, with
    every sampling round): longer than the longest step's rollout."""

    def check(self) -> None:
        _at_least(self, "distributed", ("tensor_parallel", "pipeline_parallel", "expert_parallel",
                                        "expert_tensor_parallel"), 1)
        for name in ("timeout_minutes", "rollout_timeout_minutes"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"distributed.{name}: must be > 0")


@dataclass
class OptimizerConfig:
    name: Literal["adam", "sgd"] = "adam"
    """Megatron's optimizer: `adam` or `sgd`."""
    lr: float = field(default=1e-6, metadata=RESUME)
    """The learning rate (after the warmup, before any decay)."""
    weight_decay: float = 0.0
    """Weight decay coefficient."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    """Adam's beta1, beta2 and epsilon."""
    lr_warmup_steps: int = field(default=0, metadata=RESUME)
    """Training steps (rollout batches) over which the learning rate rises linearly from 0 to
    `lr` (step k of the warmup uses lr x k / lr_warmup_steps)."""
    lr_decay: Literal["constant", "linear", "cosine"] = field(default="constant", metadata=RESUME)
    """After the warmup: keep `lr`, or decay it to `min_lr` at train.steps."""
    min_lr: float = field(default=0.0, metadata=RESUME)
    """The learning rate lr_decay reaches at train.steps."""
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables."""
    distributed_optimizer: bool = True
    """Shard optimizer states over data-parallel ranks (Megatron's distributed optimizer)."""
    cpu_offload: bool = False
    """GPU runs: Adam states and step in host memory (Megatron's HybridDeviceOptimizer), for
    models whose optimizer states do not fit beside the weights even precision-aware (235B-A22B;
    30B-A3B on 4 trainer GPUs). The GPUs wait while the host steps (the planner says how long)."""
    precision_aware: bool = False
    """GPU runs without cpu_offload: Megatron's precision-aware optimizer (Transformer Engine's
    FusedAdam): Adam's moments in bf16 and the fp32 master weights kept as the 16 bits a bf16
    weight lacks, rebuilt at each step (megatron-core 0.16.1 with TE >= 2.1), 6 bytes of state per
    parameter instead of 12. Needs model.dtype bfloat16, optimizer.name adam and the distributed
    optimizer."""
    offload_grad_buffers: bool = False
    """Colocated runs: the fp32 gradient buffers (4 bytes a parameter the GPU holds) given back
    while the engine generates and taken again once it has released its memory, before the
    update (megatron-core's DistributedDataParallel.offload_grad_buffers / restore_grad_buffers):
    room for the engine's KV cache. Needs weight_sync.colocate."""

    def check(self) -> None:
        if self.precision_aware and self.cpu_offload:
            raise ConfigError("optimizer.precision_aware: keeps bf16 Adam moments on the GPU, optimizer.cpu_offload fp32 "
                              "ones on the host: set one")
        if self.lr <= 0:
            raise ConfigError(f"optimizer.lr: {self.lr} must be > 0")
        if not 0 <= self.min_lr <= self.lr:
            raise ConfigError(f"optimizer.min_lr: {self.min_lr} must be within [0, optimizer.lr]")


@dataclass
class LossConfig:
    function: str = "gspo"
    """The policy loss: `gspo` (sequence ratio, the paper's), `gspo_token` (GSPO-token), `grpo`
    (token ratio, for comparison runs), the GSPO lineage `sapo` (soft gate), `gmpo` (geometric
    mean of log-space-clipped token ratios), `luspo` (GSPO scaled by response length), `cispo`
    (clipped, stop-gradient importance weight), or a function of yours, `module:function`, called
    as `fn(inputs: LossInputs, config: LossConfig) -> (loss, metrics)` like these (both in gspo_mcore.api).
    KL, entropy bonus, behaviour weights and the mismatch figures are added around it."""
    clip_low: float = 3e-4
    clip_high: float = 4e-4
    """The paper's GSPO clip range: ratios outside [1 - 3e-4, 1 + 4e-4] stop the gradient
    (gspo, gspo_token, grpo, luspo)."""
    aggregation: Aggregation | None = None
    """None: the loss's paper's (seq-mean-token-mean; cispo: token-mean; luspo: its length
    scaling, seq-mean-token-sum, which it refuses to change)."""
    dual_clip: float | None = None
    """Lower bound c * A for negative advantages (c > 1); None: off."""
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    """sapo: the soft gate's temperatures for positive / non-positive advantages (the paper's;
    a higher one decays faster off-policy)."""
    gmpo_log_clip: float = 0.4
    """gmpo: each token's log ratio clipped to [-eps, eps] before the geometric mean (the paper's
    0.4: ratios within (e^-0.4, e^0.4))."""
    cispo_weight_max: float = 5.0
    cispo_weight_min: float | None = None
    """cispo: bounds of the stop-gradient importance weight (1 + eps_high^IS, 1 - eps_low^IS);
    MiniMax-M1 sets no lower bound and publishes no upper one: 5, ScaleRL's eps_max."""
    mismatch_correction: MismatchCorrection = "none"
    """Importance weights for the train-inference mismatch at theta_old, rho = pi_trainer /
    pi_engine, on every loss: `token_tis` (each token's rho truncated at mismatch_threshold) or
    `sequence_mis` (a sequence's rho, the product over its tokens, kept inside [1/C, C] and 0
    outside). rho needs pi_old to be the trainer's (a step's first minibatch on-policy, or
    train.recompute_old_logprobs); elsewhere it is 1."""
    mismatch_threshold: float = 2.0
    """C of mismatch_correction (TIS's truncation, MIS's band)."""
    on_policy_first_minibatch: bool = True
    """The first minibatch of a step (theta = theta_old) takes pi_old from its own forward,
    detached: its ratio is exactly 1, free of the engine mismatch, at no extra cost (later
    minibatches keep the engine's log-probs). On by default (docs/10-findings.md)."""
    band_from_mismatch: float | None = 2.0
    """k: from the second minibatch of a step on, the clip band is at least k x the mean
    per-sequence |log pi_trainer / pi_engine| measured on the first minibatch, so the band
    absorbs the train-inference mismatch where responses are too short for length
    normalisation to shrink it below clip_low/clip_high, and is exactly the configured band
    where they are not (docs/10-findings.md). None: always the configured band."""
    token_mask_band: list[float] | None = None
    """[low, high]: tokens whose pi_theta / pi_engine leaves the band give no gradient
    (IcePop); computed from the current forward and the engine's log-probs. None: off."""
    sequence_mask_threshold: float | None = None
    """delta: sequences with negative advantage whose mean log(pi_engine / pi_theta) exceeds it
    give no gradient (DeepSeek-V3.2's off-policy sequence masking). None: off."""
    horizon: int | None = None
    """seq-mean-token-sum-norm's constant divisor (the same on every rank and minibatch);
    None: rollout.max_new_tokens."""
    kl_loss_coef: float = 0.0
    """KL penalty to the reference policy (the initial weights, frozen; a second model whose
    log-probs are computed before each step's updates); off in the paper's setup."""
    kl_estimator: KLEstimator = "k3"
    """The per-token KL estimator of kl_loss_coef's term: k1, k2 or k3 (gspo_mcore.gspo.loss.kl_penalty)."""
    entropy_coef: float = 0.0
    """Entropy bonus: the loss minus this times the policy entropy (aggregated like the loss)."""
    behavior_weight_cap: float = 2.0
    """Asynchronous modes (decoupled GSPO): each sequence's loss is weighted by its behaviour
    ratio pi_prox / pi_engine over its stale tokens (length-normalised), truncated at this."""
    proximal: Literal["recompute", "first_minibatch"] = "recompute"
    """Asynchronous modes: pi_prox, the weights at the start of the step. `recompute`: one
    forward of the batch first (exact for every minibatch). `first_minibatch`: free, from the
    first minibatch's own forward (exact there); the later minibatches take the engine's
    log-probs as pi_prox (behaviour weight 1, their band sized from the mismatch), saving the
    forward. On long_cpu, 6 seeds: inside sync's range on held-out prompts, 0.06 +- 0.04 below it
    where `recompute` is 0.03 +- 0.04 below (docs/02-async.md)."""
    log_entropy: bool = False
    """Report the policy entropy (`entropy` in metrics.jsonl; one more pass over the logits).
    Always reported when entropy_coef > 0."""

    def check(self) -> None:
        band = self.token_mask_band
        if band is not None and (len(band) != 2 or not 0 < band[0] < 1 < band[1]):
            raise ConfigError("loss.token_mask_band: expected [low, high] with 0 < low < 1 < high")
        if self.band_from_mismatch is not None and self.band_from_mismatch <= 0:
            raise ConfigError("loss.band_from_mismatch: must be > 0")
        if self.sequence_mask_threshold is not None and self.sequence_mask_threshold < 0:
            raise ConfigError("loss.sequence_mask_threshold: must be >= 0")
        if self.horizon is not None and self.horizon < 1:
            raise ConfigError("loss.horizon: must be >= 1")
        for name in ("kl_loss_coef", "entropy_coef"):
            if getattr(self, name) < 0:
                raise ConfigError(f"loss.{name}: must be >= 0")
        for name, why in foreign_fields(self.function).items():
            if getattr(self, name) != getattr(LossConfig, name):
                raise ConfigError(f"loss.{name}: {why}")
        for name in ("sapo_tau_pos", "sapo_tau_neg", "gmpo_log_clip"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"loss.{name}: must be > 0")
        if self.cispo_weight_max <= 1 or (self.cispo_weight_min is not None and not 0 < self.cispo_weight_min < 1):
            raise ConfigError("loss.cispo_weight_min / cispo_weight_max: expected 0 < min < 1 < max")
        if self.mismatch_threshold <= 1:
            raise ConfigError("loss.mismatch_threshold: must be > 1")
        if self.behavior_weight_cap < 1:
            raise ConfigError("loss.behavior_weight_cap: must be >= 1")


@dataclass
class DataConfig:
    path: str = ""
    """Prompt dataset, JSONL or Parquet: a prompt (or chat `messages`) and an `answer` per record;
    other fields go to rewards that ask for them (docs/05-data-and-rewards.md)."""
    prompt_key: str = "prompt"
    messages_key: str = "messages"
    answer_key: str = "answer"
    """The record fields of the prompt text, the chat messages and the reference answer."""
    tokenizer_dir: str | None = None
    """Tokenizer (with its chat template); None: model.hf_dir's."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra variables for the chat template, e.g. {enable_thinking: false} for Qwen3."""


@dataclass
class RewardConfig:
    name: str = "math"
    """`math` (boxed answer, math-verify), `exact_match`, or any `module:function(response, answer)`;
    a function that names `prompt`, `messages`, `extra`, `url` or a record field gets it
    (gspo_mcore/rewards/__init__.py)."""
    batched: bool = False
    """The reward takes a prompt's group in one call: lists in, a list of rewards out."""
    url: str | None = field(default=None, metadata=RESUME)
    """A server the reward calls (a reward model served by SGLang), passed as its `url` argument."""
    timeout_s: float = field(default=10.0, metadata=RESUME)
    """Per call (a response; a group when batched); a crash or timeout scores 0 and is counted."""
    max_error_fraction: float = 0.5
    """The share of a round's reward calls that may fail (raise, time out, return NaN; a response
    masked by reward.code.infrastructure_errors counts as one) before the run stops, quoting the first failure (every one is in OUTPUT_DIR/logs/reward_errors.log);
    a round where every call failed always stops it."""
    workers: int = field(default=2, metadata=RESUME)
    """Reward worker processes: calls run this many at a time."""
    norm: RewardNorm = "none"
    """Reward normalisation before the group advantages: over the batch, per prompt group, or
    by running moments across steps."""
    advantage_std_norm: bool = True
    """Divide by the group's reward std (GRPO/GSPO); false: centre only (Dr. GRPO)."""
    advantage_clip: float | None = None
    """Advantages clipped to [-c, c] after the group normalisation; None: off."""
    code: CodeRewardConfig = field(default_factory=CodeRewardConfig)
    """The code reward's settings and the sandbox's per-test limits (gspo_mcore/rewards/code_config.py,
    docs/13-code-rl.md); read by `code`, `code_all` and `code_group_reward`."""

    def check(self) -> None:
        if self.code.problem() is not None:
            raise ConfigError(f"reward.code.{self.code.problem()}")


@dataclass
class RolloutConfig:
    engine: Literal["sglang", "vllm"] = "sglang"
    """The inference engine (gspo_mcore/engines/<name>/): its servers, launch and weight transfer
    (docs/12-engines.md compares them)."""
    engine_python: str = ""
    """The Python that runs a server the run starts (relative paths from the repository); empty:
    this one. vLLM on CPU runs in its own venv: `.venv-vllm/bin/python` (make install-vllm)."""
    urls: list[str] = field(default_factory=list, metadata=RESUME)
    """Running engine servers. Empty: the run starts `num_servers` itself (the CPU default, tests)."""
    num_servers: int = field(default=1, metadata=RESUME)
    """Servers the run starts itself (urls empty), each on engine_tp GPUs."""
    mode: Literal["sync", "one_step_off", "async"] = "sync"
    """sync: generate a batch, train on it, push, repeat. one_step_off: batch k+1 is generated
    while batch k trains. async: groups stay in flight on every server continuously, paced so
    no trained token is more than max_staleness weight versions old; the trainer takes the
    oldest full batch. In both asynchronous modes a push pauses generation (requests keep their
    tokens), loads the weights and continues: responses span versions, each token's engine
    log-prob exact for its version (docs/02-async.md)."""
    max_staleness: int = 1
    """Asynchronous modes: the most weight versions between a trained token and the weights
    being updated."""
    partial: bool = True
    """Asynchronous modes: a push keeps the requests in flight, which continue under the new
    weights (nothing regenerated). false: a push aborts them and they start over from their
    prompt (tokens_regenerated counts the waste), for comparison."""
    temperature: float = 1.0
    """The engine's sampling temperature; the trainer divides its logits by it too, so the
    ratio compares the distribution that was sampled."""
    group_filter: str = "informative"
    """Dynamic sampling: which groups a step keeps. `informative`: drop groups whose rewards are
    all equal (no signal); `all`; or `module:function(rewards, group_ids) -> bool mask`."""
    oversample: float = 1.0
    """Dynamic sampling: ask for this many times more prompts, keep the first informative ones."""
    max_sampling_rounds: int = 1
    """Dynamic sampling: generation rounds per step until train.rollout_batch_size groups with
    signal are kept (DAPO); a step that still has fewer trains on those (metric groups_kept)."""
    engine_tp: int = 1
    """GPUs (tensor parallel) per engine server; the planner and launch scripts place them."""
    engine_dtype: Literal["float32", "bfloat16"] = "bfloat16"
    """dtype of a server the run starts itself."""
    server_args: list[str] = field(default_factory=list)
    """Extra arguments of the engine's server (`sglang.launch_server`, vLLM's API server) for a
    server the run starts itself."""
    max_total_tokens: int = 8192
    """A server's KV cache in tokens (a server the run starts gets it; the client keeps no more
    requests in flight than fit it, and the planner sizes the GPUs with it)."""
    max_running_requests: int = field(default=64, metadata=RESUME)
    """The most requests a server runs at once (a server the run starts gets it; the client keeps no more in flight)."""
    max_new_tokens: int = 1024
    """The longest response a request may generate, in tokens."""
    stop: list[str] = field(default_factory=list)
    """Stop strings: a response ends with the token that completes one (kept, with its log-prob).
    A server the run starts then loads the tokenizer (the engine matches them on text); servers
    started elsewhere must not run with --skip-tokenizer-init."""
    request_timeout_s: float = field(default=600.0, metadata=RESUME)
    """Per request: how long the client waits for the answer."""
    max_attempts: int = field(default=5, metadata=RESUME)
    """Per request: retries with exponential backoff across servers, then the run stops."""
    return_routed_experts: bool = False
    """Ask the engine for each token's routed experts (servers started with
    --enable-return-routed-experts; a server the run starts gets it): the metric
    routing_mismatch_fraction, and what train.routing_replay replays."""
    function: str = "single_turn"
    """How a prompt becomes trajectories: `single_turn` (one response per request), `tool_loop`
    (the model calls `tools`), or `module:function`, an async function (task, engine) ->
    Trajectory | list (their types in gspo_mcore.api; docs/03-multi-turn.md)."""
    tools: list[str] = field(default_factory=list)
    """`module:function` of plain Python functions with type hints and a docstring (their JSON
    schemas reach the model through the chat template), run in worker processes."""
    max_turns: int = 4
    """Multi-turn functions: the most model turns in one trajectory."""
    max_trajectory_tokens: int = 2048
    """Multi-turn functions: the most tokens after the prompt (model and environment)."""
    tool_timeout_s: float = 10.0
    tool_workers: int = 2
    """Tool calls: the time limit of one call (seconds), and the worker processes that run them."""

    def check(self) -> None:
        _at_least(self, "rollout", ("max_sampling_rounds", "num_servers", "engine_tp", "max_new_tokens",
                                    "max_attempts"), 1)
        if self.function == "single_turn" and self.tools:
            raise ConfigError("rollout.tools: the single_turn rollout calls no tools; set rollout.function: tool_loop "
                              "(or a function of yours)")
        if self.function == "tool_loop" and not self.tools:
            raise ConfigError("rollout.function: tool_loop needs rollout.tools (module:function, ...)")
        if self.max_turns < 1 or self.max_trajectory_tokens < 1 or self.tool_timeout_s <= 0 or self.tool_workers < 1:
            raise ConfigError("rollout.max_turns, max_trajectory_tokens, tool_workers must be >= 1 and "
                              "tool_timeout_s > 0")
        if self.mode == "sync" and not self.partial:
            raise ConfigError("rollout.partial: false applies to the asynchronous modes (a synchronous push has no "
                              "request in flight); set rollout.mode or drop it")
        if self.max_staleness < 0:
            raise ConfigError("rollout.max_staleness: must be >= 0")
        if self.oversample < 1:
            raise ConfigError("rollout.oversample: must be >= 1")
        if self.temperature <= 0:
            raise ConfigError("rollout.temperature: must be > 0 (greedy decoding has no log-probs to train on)")


@dataclass
class WeightSyncConfig:
    method: Literal["distributed", "tensor", "disk"] = "distributed"
    """distributed: process groups trainer -> engine (gloo on CPU, NCCL on GPU), servers on
    other GPUs; tensor: colocated servers read each bucket from the trainer rank on their GPU
    (CUDA IPC; shared memory on CPU), needs expert_tensor_parallel 1; disk: HF
    safetensors on a shared file system + /update_weights_from_disk."""
    bucket_mb: int = field(default=512, metadata=RESUME)
    """A weight push's bucket size (MiB): the weights travel bucket by bucket."""
    master_address: str = field(default="127.0.0.1", metadata=RESUME)
    """Address of this trainer node as the engine's servers see it (distributed method);
    `auto`: the address each owner rank reaches its server from (multi-node, where owner ranks
    sit on several nodes). The weight-sync store listens on this address only."""
    disk_dir: str | None = field(default=None, metadata=RESUME)
    """disk method: where to write the checkpoint (shared file system); None: OUTPUT_DIR/weights_sync."""
    colocate: bool = False
    """Servers share the trainer's GPUs: release their memory for training, resume before the push."""
    check_every: int = field(default=0, metadata=RESUME)
    """Every N steps, after the push, compare the engine's log-probs of probe sequences with the
    trainer's (stop if they differ beyond `check_tolerance`); 0: never."""
    check_tolerance: float | None = None
    """The largest median |engine - trainer| log-prob over the probes' response tokens the check
    accepts; None: by rollout.engine_dtype (float32 0.01, bfloat16 0.2; wrong weights give ~1)."""

    def check(self) -> None:
        _at_least(self, "weight_sync", ("bucket_mb",), 1)
        if self.method == "tensor" and not self.colocate:
            raise ConfigError("weight_sync.method: 'tensor' needs weight_sync.colocate (the servers on the trainer's GPUs)")


@dataclass
class EvalDatasetConfig:
    name: str = ""
    """Its metrics are eval/<name>/...: mean@k, pass@1..k, greedy (temperature 0), response_length, time_s."""
    path: str = ""
    """Prompt records as for training (data.path's formats and keys)."""
    reward: str = ""
    """The reward to score with (reward.name's forms); empty: reward.name."""
    samples: int = 4
    """Responses per prompt (k of mean@k / pass@k); 1 with temperature 0."""
    temperature: float = 1.0
    """0: greedy (the eval/<name>/greedy accuracy)."""
    max_new_tokens: int = 1024
    """The longest response of this evaluation, in tokens."""
    max_prompts: int = 0
    """The first N records only; 0: all."""


@dataclass
class EvalConfig:
    """Held-out evaluation on the engine right after a push (the weights evaluated are the
    version the step tagged), every `every` steps, before the first step and after the last."""
    datasets: list[EvalDatasetConfig] = field(default_factory=list)
    """Held-out prompt sets, each with its own settings (eval.datasets[].*)."""
    every: int = 0
    """Steps between evaluations; 0: only before the first step and after the last."""

    def check(self) -> None:
        names = [d.name for d in self.datasets]
        for i, d in enumerate(self.datasets):
            if not d.name or "/" in d.name or not d.path:
                raise ConfigError(f"eval.datasets[{i}]: needs a name (no '/') and a path")
            if d.samples < 1 or d.max_new_tokens < 1 or d.temperature < 0 or d.max_prompts < 0:
                raise ConfigError(f"eval.datasets[{i}] ({d.name}): samples and max_new_tokens must be >= 1, "
                                  "temperature and max_prompts >= 0")
            if d.temperature == 0 and d.samples != 1:
                raise ConfigError(f"eval.datasets[{i}] ({d.name}): temperature 0 (greedy) gives one answer: samples 1")
        if len(set(names)) != len(names):
            raise ConfigError(f"eval.datasets: names must differ ({names})")
        if self.every < 0:
            raise ConfigError("eval.every: must be >= 0")


@dataclass
class TrainConfig:
    steps: int = field(default=100, metadata=RESUME)
    """Training steps: a rollout batch and its update each."""
    seed: int = 1234
    """The run's seed: prompt order, minibatch order and sampling seeds derive from it (gspo_mcore.common.seeds)."""
    rollout_batch_size: int = 32
    """Prompts per step."""
    group_size: int = 8
    """Responses per prompt (the group GSPO normalises advantages over)."""
    num_minibatches: int = 4
    """Optimizer steps per rollout batch (the paper: 4); the first is on-policy."""
    ppo_epochs: int = 1
    """Passes over a rollout batch per step, each num_minibatches optimizer steps."""
    max_tokens_per_microbatch: int = 8192
    """Token budget per microbatch per GPU (padded length x sequences); a longer sequence goes alone."""
    recompute_old_logprobs: bool = False
    """Comparison runs: pi_old from a trainer forward instead of the engine's log-probs."""
    strict_exactness: Literal["auto", "true", "false"] = field(default="auto", metadata=RESUME)
    """Stop the run when a sequence's train-inference mismatch at theta_old (per-sequence
    |log s_i| over the tokens the current weights generated) exceeds
    `strict_exactness_tolerance`, writing the offending sequences to
    OUTPUT_DIR/logs/exactness_*.json. `auto`: on when the engine and the trainer both compute in
    float32 (rollout.engine_dtype and model.dtype), where the two agree to ~1e-6; `true` forces
    it (a bf16 engine's mismatch is ~1e-3: it fires); `false` off. On, every step forwards the
    whole batch once at theta_old (none more when pi_old or pi_prox is recomputed anyway)."""
    strict_exactness_tolerance: float = field(default=1e-4, metadata=RESUME)
    """The largest per-sequence |log s_i| strict exactness accepts (float32 on both sides gives ~1e-6)."""
    routing_replay: bool = False
    """Comparison runs (R3): the trainer's MoE routers take the engine's routed experts in
    forward and backward (megatron-core's RouterReplay) instead of routing freely. Needs
    rollout.return_routed_experts."""
    save_every: int = field(default=0, metadata=RESUME)
    """Checkpoint (model, optimizer, RNG, data position, step) every N steps; 0: only at the end."""
    keep_checkpoints: int = field(default=3, metadata=RESUME)
    """Keep the newest N checkpoints (older ones are removed once a newer one is complete); 0: all."""
    save_final: bool = field(default=True, metadata=RESUME)
    """Checkpoint the last step (false: smoke runs that keep nothing; a 30B-A3B checkpoint with
    Adam states is ~430 GB)."""
    export_hf: bool = field(default=True, metadata=RESUME)
    """Write the final weights as a Hugging Face checkpoint (OUTPUT_DIR/hf)."""
    wandb_project: str | None = field(default=None, metadata=RESUME)
    """Also log the metrics to this Weights & Biases project (the `wandb` package; WANDB_MODE=offline
    writes OUTPUT_DIR/wandb without a network, for `wandb sync` later). None: metrics.jsonl and
    TensorBoard only."""
    log_samples_every: int = 0
    """Every N steps, OUTPUT_DIR/samples/step_N.jsonl: `log_samples` training responses (prompt,
    response, reward, advantage, the reward's reason where it gave one) and the evaluation's first
    responses when it ran; 0: never."""
    log_samples: int = 8
    """Training responses per samples file (log_samples_every)."""

    def check(self) -> None:
        _at_least(self, "train", ("steps", "rollout_batch_size", "group_size", "num_minibatches", "ppo_epochs",
                                  "max_tokens_per_microbatch"), 1)
        if self.group_size < 2:
            raise ConfigError("train.group_size: must be >= 2 (a group of one has no advantage to learn from)")
        if self.strict_exactness_tolerance <= 0:
            raise ConfigError("train.strict_exactness_tolerance: must be > 0")
        if self.keep_checkpoints < 0:
            raise ConfigError("train.keep_checkpoints: must be >= 0")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def validate(self) -> "Config":
        """Every section's own checks, then those across sections (gspo_mcore.config.validate)."""
        return validate(self)

    @property
    def sync_check_tolerance(self) -> float:
        """weight_sync.check_tolerance, or the engine dtype's."""
        if self.weight_sync.check_tolerance is not None:
            return self.weight_sync.check_tolerance
        return {"float32": 0.01, "bfloat16": 0.2}[self.rollout.engine_dtype]

    @property
    def strict(self) -> bool:
        """train.strict_exactness resolved: `auto` is on where both sides compute in float32."""
        if self.train.strict_exactness == "auto":
            return self.model.dtype == "float32" and self.rollout.engine_dtype == "float32"
        return self.train.strict_exactness == "true"

    @property
    def horizon(self) -> int:
        """seq-mean-token-sum-norm's divisor: loss.horizon, else the longest response allowed."""
        return self.loss.horizon or self.rollout.max_new_tokens


def resume_fields(cls=None, prefix: str = "") -> frozenset[str]:
    """The dotted names of the fields a `--resume` may change (metadata RESUME), sections within
    sections included."""
    cls, names = cls or Config, set()
    hints = get_type_hints(cls)
    for f in fields(cls):
        if f.metadata.get("resume"):
            names.add(f"{prefix}{f.name}")
        if is_dataclass(hints[f.name]):
            names |= resume_fields(hints[f.name], f"{prefix}{f.name}.")
    return frozenset(names)
