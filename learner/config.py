"""`gagpo-learner` configuration: one typed model, loaded from TOML ([learner]) and flags.

Light to import (no torch): the CLI validates a config before any heavy import.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from gagpo.pipeline.config import EstimatorConfig, GagpoConfig
from gagpo.schemas.config import Config
from gagpo.schemas.errors import GagpoError
from gagpo.schemas.layout import MAX_VERSION

# A decay rate of AdamW's moment estimates: torch refuses one outside [0, 1) only when the
# optimiser is built, after the model has loaded.
Beta = Annotated[float, Field(ge=0.0, lt=1.0)]

# Settings that were removed, and the line an old config that still sets one gets.
REMOVED = {
    "checkpoint_every": "every published version carries its lineage, and the training state "
    "is saved every state_every updates (learner/checkpoints/v<N>/); use state_every instead",
}


class LossSettings(Config):
    """Hyper-parameters of the objective (docs/design.md §4), as `gagpo_loss` takes them."""

    eps_low: float = Field(0.2, ge=0.0, lt=1.0)
    """ε_low: the ratio is clipped below at 1 − ε_low."""
    eps_high: float = Field(0.28, ge=0.0, le=10.0)
    """ε_high: the ratio is clipped above at 1 + ε_high."""
    behavior_cap: float = Field(2.0, ge=1.0, le=1e6)
    """C: truncation of the detached behaviour weight w = min(π_prox/π_behav, C)."""
    bypass: bool = False
    """Set π_prox = π_behav (w = 1): skips the proximal pass, plain clipped PPO on stale data."""
    ratio_level: Literal["action", "token", "sequence"] = "action"
    """Importance ratio per action (length-normalised, the default), per token or sequence-sum (ablations)."""
    aggregation: Literal["action_mean", "token_mean"] = "action_mean"
    """Average the loss over actions (default) or over tokens."""
    kl_coef: float = Field(0.0, ge=0.0, le=100.0)
    """Weight of the KL penalty to the base (reference) policy; 0 loads no reference model."""
    entropy_coef: float = Field(0.0, ge=0.0, le=100.0)
    """Weight of the entropy bonus; 0 skips computing the entropy."""
    log_ratio_bound: float = Field(20.0, gt=0.0, le=80.0)
    """|log ρ| and |log w| are clamped here before exp, so no inf or NaN reaches the optimiser."""


class LoraSettings(Config):
    """Low-rank adapters instead of full fine-tuning."""

    enabled: bool = False
    """Train LoRA adapters on the target modules; the base weights stay frozen."""
    rank: int = Field(8, ge=1, le=1024)
    """r: rank of each adapter."""
    alpha: float = Field(16.0, gt=0.0, le=1e4)
    """Scaling numerator: the adapter's output is multiplied by alpha / r."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on each adapter's input while training (peft's lora_dropout); above 0, π_prox takes its own pass."""
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1
    )
    """Names of the linear layers that get adapters (suffix match on module names, as peft matches)."""
    publish: Literal["merged", "adapter"] = "merged"
    """Publish full merged weights (any loader), or a PEFT-format adapter folder beside the base config."""


class CompactionSettings(Config):
    """Background compaction of consumed shards into archive segments (docs/store.md)."""

    every_updates: int = Field(50, ge=0, le=10**9)
    """Compact after this many updates since the last compaction; 0: only by size (or never,
    with min_mib = 0 too)."""
    min_mib: float = Field(64.0, ge=0.0, le=1e6)
    """Or sooner, once the consumed shards still in the inbox hold this many MiB; 0: only by
    updates."""
    segment_mib: float = Field(64.0, gt=0.0, le=1e6)
    """Target size of a segment, in MiB of the shards it takes in (a compaction holds about
    15 times that in memory at its peak); the newest segment grows until it reaches it."""

    @property
    def enabled(self) -> bool:
        return self.every_updates > 0 or self.min_mib > 0


class LearnerConfig(Config):
    """`gagpo-learner`: train on committed shards with the GAGPO objective and publish versions."""

    store: str = Field(..., min_length=1)
    """Store root the actors write into: a local path or an fsspec URL (s3://bucket/prefix)."""
    policy: str = "tiny"
    """Base policy (version 0): a preset name (tiny, smollm2-135m) or a Hugging Face model folder."""
    mode: Literal["rl", "sft"] = "rl"
    """rl: the GAGPO objective on the estimator's advantages; sft: supervised token-mean NLL of
    the action tokens (warm start from demonstrations, docs/warmstart.md), no staleness drop."""
    updates: int = Field(100, ge=1)
    """Number of policy updates to run (counted across restarts: --resume continues the count).
    Each update publishes a version: at most 9,999,999, the last version a store can name."""
    batch_groups: int = Field(8, ge=1, le=1_000_000)
    """B: whole groups per update batch."""
    max_staleness: int = Field(4, ge=0, le=1_000_000)
    """Groups generated more than this many versions behind the learner are dropped (and counted)."""
    mini_batches: int = Field(1, ge=1, le=4096)
    """Optimiser steps per update, each over a slice of the batch's groups (π_prox stays the start-of-update policy)."""
    micro_batch_tokens: int = Field(8192, ge=16, le=10**8)
    """Padded tokens (rows × longest row) per forward/backward; gradients accumulate across micro-batches."""
    lr: float = Field(1e-5, gt=0.0, le=1.0)
    """Peak learning rate of AdamW."""
    warmup_steps: int = Field(0, ge=0, le=10**9)
    """Optimiser steps of linear learning-rate warm-up from lr/(warmup_steps+1) to lr."""
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    """After the warm-up: keep lr, or decay it (half-cosine or linearly) to lr·lr_final at the
    last of the run's optimiser steps (updates × mini_batches), so that the last versions move
    less once learning has plateaued."""
    lr_final: float = Field(0.1, ge=0.0, le=1.0)
    """The decayed schedules' final learning rate, as a fraction of lr."""
    weight_decay: float = Field(0.0, ge=0.0, le=1.0)
    """AdamW decoupled weight decay."""
    adam_betas: tuple[Beta, Beta] = (0.9, 0.999)
    """AdamW (β1, β2), each in [0, 1): the decay rates of the moment estimates."""
    adam_eps: float = Field(1e-8, gt=0.0, le=1.0)
    """AdamW ε, added to √v̂: parameters whose gradients stay below it move less than lr a step
    (raise it when noisy policy gradients move every weight by a full lr)."""
    grad_clip: float = Field(1.0, ge=0.0, le=1e6)
    """Clip the global gradient norm to this value; 0 disables clipping (the norm is still logged)."""
    temperature: float = Field(1.0, gt=0.0, le=10.0)
    """Softmax temperature of π_θ; must equal the actors' sampling temperature (behaviour log-probs are tempered)."""
    loss: LossSettings = Field(default_factory=LossSettings)
    """The objective's hyper-parameters."""
    estimator: EstimatorConfig = Field(default_factory=GagpoConfig)
    """Advantage estimator run on each shard before training (see `gagpo advantages`)."""
    write_advantages: bool = True
    """Also commit each shard's advantage table under advantages/<estimator_tag>/ for SQL inspection."""
    keep_versions: int = Field(3, ge=1, le=1_000_000)
    """K: published policy versions kept in policy/; older ones are deleted (LATEST's is always kept)."""
    keep_every: int = Field(0, ge=0, le=10**9)
    """Also keep every N-th version (v0, vN, v2N, …) in policy/, e.g. to evaluate them after
    the run (`gagpo run` with [run] eval_groups); 0 keeps only the newest K."""
    keep_checkpoints: int = Field(2, ge=1, le=1000)
    """Training states kept in learner/checkpoints/ (the newest complete ones)."""
    state_every: int = Field(20, ge=1, le=10**6)
    """Save the training state (optimiser, scheduler, RNG) every this many updates, and at
    the end of a run. --resume continues from LATEST's weights with the newest state's
    optimiser (an approximation when that state is older: docs/design.md, "One lineage").
    LoRA runs save theirs with every version (small, and not recoverable from merged weights)."""
    state_async: bool = True
    """Write the training state in a thread while the next update runs (the critical path
    only copies it to CPU memory); false: write it before publishing, on the critical path."""
    publish_async: bool = True
    """Write each policy version in a thread while the next update runs (the critical path
    only copies the weights to CPU memory, in `publish_dtype`); the thread moves LATEST
    once the folder is complete, and the next publication waits for it. False: write it
    before the next update starts. LoRA runs and a run's last version publish at once."""
    publish_delta_every: int = Field(0, ge=0, le=100)
    """K: publish a bf16 version as a zstd-compressed XOR of its bits with the previous
    version's (storage/delta.py), with a full version every K (and every `keep_every`, and
    the first after a start); 0 publishes every version full. Actors and --resume apply
    the deltas into their local cache (at most K-1 of them). fp32 publication, LoRA adapters
    and sharded (FSDP) folders are always full. Off by default: benchmarks/RESULTS.md,
    "Delta publication" (3.7 % of the bytes per delta; K = 10 suits object stores)."""
    publish_dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """Dtype of the published weights: auto follows `precision` (bf16 training publishes
    bf16, what actors serve on a GPU, half the bytes of fp32), or fp32 / bf16 whatever the
    precision. LoRA adapters (lora.publish = "adapter") are written as trained."""
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")
    """Where to train: auto, cpu, cuda or cuda:N (under torchrun each process takes its local rank's GPU)."""
    parallel: Literal["ddp", "fsdp"] = "ddp"
    """Under torchrun: ddp keeps a whole model per process and sums gradients with one
    all-reduce per step; fsdp shards parameters, gradients and optimiser state (FSDP2, one
    unit per decoder layer) for models too big for one device. One process: no difference."""
    seed: int = Field(0, ge=0, le=2**62)
    """Seed of torch's generators (LoRA initialisation, dropout)."""
    poll_interval_s: float = Field(2.0, gt=0.0, le=3600.0)
    """Seconds between two listings of STORE/shards/ while waiting for data."""
    idle_timeout_s: float | None = Field(None, gt=0.0)
    """Stop (after a final checkpoint) when no usable data arrived for this long; default: wait forever."""
    replay: str | None = None
    """Train offline on the steps of this store, archive and inbox (read only; no waiting,
    no staleness drop)."""
    replay_as_of_update: int | None = Field(None, ge=0)
    """With replay: only the groups the replayed store's learner trained in updates up to
    this one, batched in the order it trained them (replay a run exactly)."""
    compaction: CompactionSettings = Field(default_factory=CompactionSettings)
    """When the learner compacts consumed shards into the archive, in the background."""
    resume: bool = False
    """Continue the lineage from the version policy/LATEST names, with its own weights, optimiser and ledger."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """fp32 everywhere (the default, for CPU), or bf16: bfloat16 compute over float32 master
    weights (autocast; FSDP2 MixedPrecisionPolicy under parallel = fsdp). See docs/gpu.md."""
    merge_turns: bool = True
    """Encode each trajectory's steps whose prompts extend the previous step's prompt and
    action as one sequence, reading every action's log-probs at its own positions (tokens
    grow with the turns, not their square; the loss is the same); false: one row per step
    (the ablation)."""
    prefix_trie: bool = False
    """Encode each group's steps as one prefix trie (learner/trie.py): every distinct prefix
    of the group's prompt + action sequences once, each action scored on its own context
    through a tree attention mask (the loss is the same); metric tree_token_ratio."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory, about a third more compute."""
    lora: LoraSettings = Field(default_factory=LoraSettings)
    """Low-rank adapter training."""
    log_to: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(default_factory=list)
    """Trackers that also get every update's metrics, same names (the store's learner/metrics/
    stays the record): tensorboard, wandb (offline without WANDB_API_KEY), mlflow."""
    log_dir: str | None = None
    """Folder of the TensorBoard event files (and of offline wandb / local mlflow runs);
    default STORE/learner/tensorboard/ on a local store, ./gagpo-runs/ otherwise."""

    @model_validator(mode="before")
    @classmethod
    def _removed_settings(cls, data: Any) -> Any:
        # A GagpoError, not a ValueError: pydantic passes it through as the one line itself.
        for key, why in REMOVED.items():
            if isinstance(data, dict) and key in data:
                raise GagpoError(f"config field '{key}' was removed: {why}")
        return data

    @field_validator("estimator", mode="before")
    @classmethod
    def _default_estimator_name(cls, value: object) -> object:
        # A TOML [learner.estimator] table may omit `estimator`: GAGPO is the default.
        if isinstance(value, dict) and "estimator" not in value:
            return {"estimator": "gagpo", **value}
        return value

    @field_validator("adam_betas", mode="before")
    @classmethod
    def _betas_from_list(cls, value: object) -> object:
        # TOML and --set give a list; strict validation takes only a tuple for a tuple field.
        return tuple(value) if isinstance(value, list) else value

    @field_validator("updates")
    @classmethod
    def _updates_nameable(cls, value: int) -> int:
        if value > MAX_VERSION - 1:
            raise ValueError(
                f"{value} updates would publish versions past v{MAX_VERSION - 1}, the last a "
                f"store can name; accepted: 1 to {MAX_VERSION - 1}"
            )
        return value

    @field_validator("mini_batches")
    @classmethod
    def _mini_batches_fit(cls, value: int, info: ValidationInfo) -> int:
        groups = info.data.get("batch_groups")
        if groups is not None and value > groups:
            raise ValueError(
                f"must not exceed batch_groups ({groups}): each optimiser step needs a group"
            )
        return value

    @model_validator(mode="after")
    def _as_of_needs_replay(self) -> LearnerConfig:
        if self.replay_as_of_update is not None and self.replay is None:
            raise ValueError("replay_as_of_update needs replay; accepted: --replay STORE with it")
        return self

    @model_validator(mode="after")
    def _fsdp_without_lora(self) -> LearnerConfig:
        if self.parallel == "fsdp" and self.lora.enabled:
            raise ValueError(
                "parallel = fsdp does not support LoRA adapters yet; accepted: parallel = ddp "
                "with lora (the frozen base is not sharded), or fsdp with full fine-tuning"
            )
        return self
