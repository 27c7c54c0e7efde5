"""reasoning-gym's procedural datasets as one-turn tasks (`--env reasoning_gym/leg_counting`).

reasoning-gym (open-thought) makes questions with checkable answers: a dataset is built
once, with `reasoning_gym.create_dataset(name, size=..., seed=...)` and the dataset's
own options, when the environment is made (one per slot, not per rollout); task seed `s`
plays entry `s mod size`, which the dataset generates from its seed and index alone.

- the observation is the question; the reply (its first line, as the actors read replies)
  is the answer, scored by the dataset's own `score_answer` in [0, 1]: that is the reward;
- state key: the question text (one-turn: every rollout of a group starts there, and the
  episode ends after the answer);
- invalid: an empty answer (reasoning-gym has no other notion of an unreadable reply);
- won: `score_answer` gave 1.0 (reasoning-gym's "correct").
"""

from __future__ import annotations

from typing import Any

from gagpo.envs.base import Reset, Transition
from gagpo.envs.library import LibraryEnv, import_library
from gagpo.schemas.errors import GagpoError

PREFIX = "reasoning_gym/"
INSTRUCTIONS = (
    "Answer the question. Reply with the final answer alone, on one line, in the form the "
    "question asks for."
)


class ReasoningGymEnv(LibraryEnv):
    """One reasoning-gym dataset (see the module docstring)."""

    def __init__(
        self, dataset: str, *, max_turns: int, size: int = 1000, seed: int = 0, **config: Any
    ) -> None:
        super().__init__(f"{PREFIX}{dataset}", max_turns)
        rg = import_library("reasoning_gym")
        if size < 1:
            raise GagpoError(f"environment {self.name!r}: size must be at least 1, got {size}")
        try:
            self.dataset = rg.create_dataset(dataset, size=size, seed=seed, **config)
        except (ValueError, TypeError, AssertionError) as exc:
            raise GagpoError(f"environment {self.name!r}: reasoning-gym says {exc}") from None
        self.size = size
        self.entry: dict[str, Any] | None = None

    def reset(self, task_seed: int) -> Reset:
        self.entry = self.dataset[task_seed % self.size]
        question = str(self.entry["question"]).strip()
        self._begin(question)
        return Reset(question, question, None)

    def step(self, reply: str) -> Transition:
        self._check_running()
        assert self.entry is not None
        answer = reply.strip()
        score = float(self.dataset.score_answer(answer or None, self.entry))
        return self._end_turn(
            observation=f"The answer {'is correct' if score >= 1.0 else 'scored ' + format(score, '.2f')}.",
            reward=score,
            done=True,
            valid=bool(answer),
            won=score >= 1.0,
            key="",
        )

    @property
    def instructions(self) -> str:
        return INSTRUCTIONS

    def expert_plan(self) -> list[str] | None:
        """The dataset's own answer (reasoning-gym stores it with every entry)."""
        return None if self.entry is None else [str(self.entry["answer"])]
