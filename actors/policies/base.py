"""The policy backend interface the rollout loop samples from.

A backend holds one policy version. It turns a chat into prompt token ids and samples
one reply per prompt, returning every sampled token with its log-probability under the
distribution it was sampled from: these become the steps table's `action_ids` and
`behavior_logprobs` (docs/design.md §3), which the learner's staleness correction divides by.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

# One source for the sampling config: the CLI/TOML models in schemas/ own it.
from gagpo.actors.config import SamplingConfig
from gagpo.schemas.seeds import derive_seed

__all__ = ["PolicyBackend", "Sample", "SamplingConfig", "prompt_budget", "request_seed"]


def request_seed(seed: int, index: int) -> int:
    """A distinct, reproducible seed for prompt `index` of a call (or turn) seeded with `seed`."""
    return derive_seed(seed, index)


def prompt_budget(sampling: SamplingConfig, context: int) -> int:
    """The longest native prompt: `max_prompt_tokens` where set, and never more than the
    model's context less the native reply budget `max_new_tokens` (its default)."""
    room = context - sampling.max_new_tokens
    asked = sampling.max_prompt_tokens
    return max(1, room if asked is None else min(asked, room))


@dataclass(frozen=True)
class Sample:
    """One sampled reply."""

    text: str  # decoded reply, special tokens stripped
    token_ids: list[int]  # sampled reply tokens, EOS included when sampled, no padding
    logprobs: list[float]  # log-prob of each sampled token under the sampling distribution

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):  # the column contract, checked at birth
            raise ValueError(
                f"sample has {len(self.token_ids)} token ids but {len(self.logprobs)} logprobs"
            )


@runtime_checkable
class PolicyBackend(Protocol):
    """A loaded policy: chat → prompt ids, prompt ids → one sampled reply each."""

    version: int  # policy version whose weights are loaded
    model_dir: Path  # the Hugging Face folder the weights came from

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Chat template + generation prompt, whole. Backends with a model also say
        `context` (tokens the model attends to) and `prompt_budget` (`prompt_budget`
        above); the rollout loop keeps native prompts within it (actors/rollout.py)."""
        ...

    def generate(
        self, prompts: list[list[int]], *, seed: int | None = None, max_tokens=None
    ) -> list[Sample]:
        """One sample per prompt, in order, sampled in batches; deterministic given `seed`.
        `max_tokens`: each prompt's reply budget (None: `sampling.max_new_tokens`), passed
        only for agents' calls, whose budgets are their own (envs/openai_chat.py)."""
        ...
