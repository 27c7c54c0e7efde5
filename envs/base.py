"""The environment protocol every actor environment implements.

An environment is deterministic given its task seed, so the G rollouts of a group
start from the same state and meet identical `state_key`s again where they can.
`state_key` is the canonical text of the environment state without dialogue history:
equal strings mean the same state (docs/design.md §3, §5).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Protocol, runtime_checkable

# Reward given for a reply the environment cannot parse or apply; the state is unchanged.
INVALID_ACTION_PENALTY = -0.1


@dataclass(frozen=True)
class Reset:
    """What `reset` returns: the first observation of an episode."""

    observation: str
    state_key: str
    admissible: tuple[str, ...] | None  # None where the environment has no such list


@dataclass(frozen=True)
class Transition:
    """What `step` returns for one agent turn."""

    observation: str  # what the agent sees next
    state_key: str  # state at decision time (before the action)
    next_state_key: str | None  # state after the action; None after a terminal step
    reward: float
    done: bool  # true terminal
    truncated: bool  # cut at the turn limit after this step
    action_valid: bool
    admissible: tuple[str, ...] | None  # admissible actions in the next state
    # The episode ended with its task accomplished (steps schema 1.1). A lost game is
    # `done` but not won; a truncated or abandoned rollout is never won.
    won: bool = False


@runtime_checkable
class Environment(Protocol):
    """One episode at a time; build a fresh instance (or call reset) per rollout."""

    name: str
    max_turns: int

    def reset(self, task_seed: int) -> Reset: ...

    def step(self, reply: str) -> Transition: ...

    @property
    def instructions(self) -> str:
        """Rules of the environment and the reply format, for the system prompt."""
        ...

    def expert_plan(self) -> list[str] | None:
        """Commands that solve the current task from its start, where known."""
        ...

    @classmethod
    def vocabulary(cls) -> list[str]:
        """Every word the command grammar can produce (for word-level tiny policies)."""
        ...


@runtime_checkable
class StepOracle(Protocol):
    """A capability an environment class declares by defining both methods: it knows, for a
    state key, which moves start a shortest solution from there. Post-run steps (the credit
    comparison of `gagpo run`, the compare page of `gagpo view`) ask for it through
    `gagpo.envs.step_oracle(name)`, never by an environment's name."""

    @classmethod
    def optimal_moves(cls, state_key: str) -> frozenset[str]:
        """The moves that start a shortest solution from this state; empty where none is
        left (solved, or unsolvable within the oracle's horizon): such a step has no label."""
        ...

    @classmethod
    def parse_move(cls, reply: str) -> str | None:
        """The move a reply names, as `optimal_moves` spells it; None if it names none."""
        ...


@runtime_checkable
class Replanner(Protocol):
    """A capability an environment declares by defining `replan`: a fresh expert plan from
    the current state, so a noisy demonstrator (actors/demos.py) resumes solving after a
    random detour instead of replaying a plan that no longer fits."""

    def replan(self) -> list[str] | None:
        """Commands that solve the task from the current state; None where unknown."""
        ...


@dataclass(frozen=True)
class Capabilities:
    """What an environment declares beyond the protocol, read by `capabilities`:

    - `step_oracle`: the class is a `StepOracle` (credit AUC in `gagpo run` and `gagpo view`);
    - `replan`: instances are `Replanner`s (noisy expert demonstrations);
    - `thread_safe`: False where the class says `thread_safe = False` (an engine with
      process-global state, such as TextWorld's): slots step it one call at a time
      (actors/slots.py). Everything else is taken to be safe to step beside other slots.

    Every environment may return an expert plan (`expert_plan`, None where it has none);
    that is part of the protocol, not a capability."""

    step_oracle: bool = False
    replan: bool = False
    thread_safe: bool = True

    def names(self) -> list[str]:
        """The capabilities declared, as docs/environments.md spells them."""
        flags = {"step oracle": self.step_oracle, "replan": self.replan}
        return [name for name, on in flags.items() if on] + (
            [] if self.thread_safe else ["one call at a time"]
        )


def capabilities(target: object) -> Capabilities:
    """The capabilities an environment class (or an instance's class) declares."""
    return _declared(target if isinstance(target, type) else type(target))


@cache
def _declared(cls: type) -> Capabilities:
    return Capabilities(
        step_oracle=isinstance(cls, StepOracle),
        replan=callable(getattr(cls, "replan", None)),
        thread_safe=bool(getattr(cls, "thread_safe", True)),
    )
