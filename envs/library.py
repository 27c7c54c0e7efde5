"""What the adapters of third-party libraries share (TextArena, GEM, reasoning-gym, OpenEnv).

Each library is selected by a name of its family (`textarena/TowerOfHanoi-v0`,
`gem/game:GuessTheNumber-v0-easy`, `reasoning_gym/leg_counting`,
`openenv+http://HOST:PORT`) and plays through its own protocol. An adapter is built
once per rollout slot and reset per rollout: `reset(seed)` must give a fresh episode of
that seed however many episodes the instance played before (docs/environments.md).

Rewards are the library's own; no project penalty is added to an invalid reply, since
each library already prices it (GEM's format error, TextArena's invalid-move ending).
"""

from __future__ import annotations

import json
from typing import Any

from gagpo.envs.base import Transition
from gagpo.envs.external import require
from gagpo.schemas.errors import GagpoError

# Exact pins: the versions the adapters and their tests were written against (Makefile).
PIP = {
    "textarena": "pip install 'gagpo[textarena]'  (textarena==0.7.4)",
    "gem": "pip install 'gagpo[gem]'  (gem-llm==0.1.0 reasoning-gym==0.1.23)",
    "reasoning_gym": "pip install 'gagpo[reasoning-gym]'  (reasoning-gym==0.1.23)",
}


def import_library(module: str) -> Any:
    """The library's module, or a GagpoError naming the pip command."""
    return require(module, PIP[module])


def _plain(value: Any) -> Any:
    """JSON-able form of a value for a state key: sets sorted, tuples as lists, objects as text."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((_plain(v) for v in value), key=repr)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "tolist"):  # numpy arrays and scalars
        return _plain(value.tolist())
    return str(value)


def is_data(value: Any) -> bool:
    """Whether `value` is plain data (no objects, callables or iterators), to the bottom."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, dict):
        return all(isinstance(k, (str, int)) and is_data(v) for k, v in value.items())
    if isinstance(value, (list, tuple, set, frozenset)):
        return all(is_data(v) for v in value)
    return False


def canonical(value: Any) -> str:
    """The canonical text of a state: sorted-key JSON, equal for equal states."""
    return json.dumps(_plain(value), sort_keys=True, separators=(",", ":"))


class LibraryEnv:
    """Turn bookkeeping of one episode at a time; subclasses play the library."""

    name: str
    max_turns: int

    def __init__(self, name: str, max_turns: int) -> None:
        if max_turns < 1:
            raise GagpoError(f"max_turns must be at least 1, got {max_turns}")
        self.name = name
        self.max_turns = max_turns
        self._key = ""
        self._turn = 0
        self._over = True

    def _begin(self, key: str) -> None:
        self._key, self._turn, self._over = key, 0, False

    def _check_running(self) -> None:
        if self._over:
            raise RuntimeError(
                f"the {self.name} episode is over (or never began); call reset() first"
            )

    def _end_turn(
        self,
        *,
        observation: str,
        reward: float,
        done: bool,
        valid: bool,
        won: bool,
        key: str,
        admissible: tuple[str, ...] | None = None,
        truncated: bool = False,
    ) -> Transition:
        before = self._key
        self._turn += 1
        truncated = not done and (truncated or self._turn >= self.max_turns)
        self._over = done or truncated
        self._key = key
        return Transition(
            observation=observation,
            state_key=before,
            next_state_key=None if done else key,
            reward=float(reward),
            done=done,
            truncated=truncated,
            action_valid=valid,
            admissible=() if done else admissible,
            won=won and done,
        )

    def expert_plan(self) -> list[str] | None:
        return None

    @classmethod
    def vocabulary(cls) -> list[str]:
        """Library games are not part of the tiny policy's vocabulary (see docs)."""
        return []
