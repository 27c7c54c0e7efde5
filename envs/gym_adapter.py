"""Users' own environments: any Gymnasium-style text environment as an `Environment`.

A Gymnasium-style environment has `reset(seed=...) -> (observation, info)` and
`step(action) -> (observation, reward, terminated, truncated, info)` with text
observations and text actions. Nothing here imports gymnasium: the adapter only calls
those two methods (duck typing), so `gymnasium.Env` subclasses and plain classes both fit.
The old Gym protocol is accepted too: `reset` returning the observation alone, `step`
returning `(observation, reward, done, info)` (done with `info["TimeLimit.truncated"]`
is a truncation, as old Gym's TimeLimit said). Anything else is one line, never a traceback.

What the project needs beyond that interface comes from `info` or the environment:

- `state_key`: `info[state_key]` (default key "state_key"), or a function named as
  "module:function" called with (observation, info), or with (observation, info, env=env)
  where it takes an `env` parameter (hidden state), or "observation" to use the
  observation text itself (right when the observation is the whole state);
- admissible commands: `info["admissible_commands"]` where present (key configurable);
- the expert plan: `info["expert_plan"]` at reset, else the environment's
  `expert_plan` attribute or method, where present;
- `won`: `info["won"]` on the terminating step where present, else false;
- `action_valid`: false when the environment listed admissible commands and the reply
  names none of them, or when `info[valid_key]` (default "action_valid") is false;
- a broken start: a reset whose `info[error_key]` is set, or whose observation begins
  with `error_prefix` ("ERROR:", as TextWorld-Express reports an uninitialised
  generator), is refused with one line;
- the system prompt: the environment's `instructions` attribute, else the `instructions`
  option, else a generic one.

The adapter is built once per slot and reset per rollout: `reset` must give a fresh
episode of its seed however often it is called (docs/environments.md).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from gagpo.envs.base import Reset, Transition
from gagpo.envs.external import match_command
from gagpo.schemas.errors import GagpoError
from gagpo.schemas.loader import load_object

# Options of the adapter itself; every other option goes to the environment's constructor.
ADAPTER_OPTIONS = (
    "state_key",
    "admissible_key",
    "won_key",
    "expert_key",
    "valid_key",
    "error_key",
    "error_prefix",
    "instructions",
)
GENERIC_INSTRUCTIONS = (
    "You are playing a text game. Read each observation and act to complete the task. "
    "Reply with exactly one command."
)


def _resolve_function(spec: str) -> tuple[Callable[..., Any], bool]:
    """The function `spec` names and whether it takes the environment (`env` parameter)."""
    accepted = "an info key, 'observation', or 'module:function'"
    fn = load_object(spec, f"state_key function {spec!r}", accepted)
    try:
        takes_env = "env" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        takes_env = False
    return fn, takes_env


class GymAdapter:
    """Wraps one Gymnasium-style environment instance (see the module docstring)."""

    def __init__(
        self,
        env: Any,
        *,
        name: str,
        max_turns: int,
        state_key: str = "state_key",
        admissible_key: str = "admissible_commands",
        won_key: str = "won",
        expert_key: str = "expert_plan",
        valid_key: str = "action_valid",
        error_key: str = "error",
        error_prefix: str = "ERROR:",
        instructions: str | None = None,
    ) -> None:
        if max_turns < 1:
            raise GagpoError(f"max_turns must be at least 1, got {max_turns}")
        for method in ("reset", "step"):
            if not callable(getattr(env, method, None)):
                raise GagpoError(
                    f"environment {name!r} has no {method}() method; accepted: a Gymnasium-style "
                    "environment with reset(seed=...) and step(action)"
                )
        self.env = env
        self.name = name
        self.max_turns = max_turns
        self._state_fn, self._fn_takes_env = (
            _resolve_function(state_key) if ":" in state_key else (None, False)
        )
        self._state_key = state_key
        self._admissible_key = admissible_key
        self._won_key = won_key
        self._expert_key = expert_key
        self._valid_key = valid_key
        self._error_key = error_key
        self._error_prefix = error_prefix
        own = getattr(env, "instructions", None)
        self._instructions = own if isinstance(own, str) else instructions
        self._plan: list[str] | None = None
        self._key = ""
        self._commands: tuple[str, ...] | None = None
        self._turn = 0
        self._over = True

    def _observation(self, observation: Any) -> str:
        if not isinstance(observation, str):
            raise GagpoError(
                f"environment {self.name!r} returned a {type(observation).__name__} observation; "
                "accepted: text (str) observations"
            )
        return observation

    def _state(self, observation: str, info: Mapping[str, Any]) -> str:
        if self._state_fn is not None:
            if self._fn_takes_env:
                return str(self._state_fn(observation, info, env=self.env))
            return str(self._state_fn(observation, info))
        if self._state_key == "observation":
            return observation
        if self._state_key not in info:
            raise GagpoError(
                f"environment {self.name!r} gives no {self._state_key!r} in info; accepted: "
                "name an info key (env option state_key), 'observation', or 'module:function'"
            )
        return str(info[self._state_key])

    def _admissible(self, info: Mapping[str, Any]) -> tuple[str, ...] | None:
        commands = info.get(self._admissible_key)
        return None if commands is None else tuple(str(c) for c in commands)

    def _info(self, info: Any, where: str) -> dict[str, Any]:
        if info is None:
            return {}
        if not isinstance(info, Mapping):
            raise GagpoError(
                f"environment {self.name!r} returned a {type(info).__name__} info from {where}; "
                "accepted: a dict"
            )
        return dict(info)

    def reset(self, task_seed: int) -> Reset:
        result = self.env.reset(seed=task_seed)
        if isinstance(result, str):  # old Gym: the observation alone
            observation, info = result, {}
        elif isinstance(result, tuple) and len(result) == 2:
            observation, info = result
        else:
            raise GagpoError(
                f"environment {self.name!r}: reset() returned {_shape(result)}; accepted: "
                "(observation, info) or an observation"
            )
        observation, info = self._observation(observation), self._info(info, "reset()")
        broken = info.get(self._error_key)
        if broken or (self._error_prefix and observation.lstrip().startswith(self._error_prefix)):
            reason = broken if broken and broken is not True else observation.strip()
            raise GagpoError(
                f"environment {self.name!r} reports it is broken at reset (seed {task_seed}): "
                + " ".join(str(reason).split())[:300]
            )
        plan = info.get(self._expert_key)
        if plan is None:
            own = getattr(self.env, "expert_plan", None)
            plan = own() if callable(own) else own
        self._plan = None if plan is None else [str(c) for c in plan]
        self._key = self._state(observation, info)
        self._commands = self._admissible(info)
        self._turn = 0
        self._over = False
        return Reset(observation, self._key, self._commands)

    def _step(self, command: str) -> tuple[Any, Any, bool, bool, Any]:
        result = self.env.step(command)
        if isinstance(result, tuple) and len(result) == 5:
            observation, reward, terminated, truncated, info = result
            return observation, reward, bool(terminated), bool(truncated), info
        if isinstance(result, tuple) and len(result) == 4:  # old Gym: (obs, reward, done, info)
            observation, reward, done, info = result
            cut = bool(done) and isinstance(info, Mapping) and bool(info.get("TimeLimit.truncated"))
            return observation, reward, bool(done) and not cut, cut, info
        raise GagpoError(
            f"environment {self.name!r}: step() returned {_shape(result)}; accepted: "
            "(observation, reward, terminated, truncated, info) or old Gym's "
            "(observation, reward, done, info)"
        )

    def step(self, reply: str) -> Transition:
        if self._over:
            raise RuntimeError(
                f"the {self.name} episode is over (or never began); call reset() first"
            )
        before = self._key
        # With a list of admissible commands, a reply naming none of them is invalid; it is
        # still sent as it is, so the environment's own dynamics answer it.
        listed = self._commands
        named = match_command(reply, listed) if listed else None
        observation, reward, terminated, truncated, info = self._step(named or reply)
        observation, info = self._observation(observation), self._info(info, "step()")
        self._turn += 1
        done = terminated
        truncated = not done and (truncated or self._turn >= self.max_turns)
        self._over = done or truncated
        self._key = self._state(observation, info)
        self._commands = self._admissible(info)
        valid = bool(info.get(self._valid_key, True)) and (named is not None or not listed)
        return Transition(
            observation=observation,
            state_key=before,
            next_state_key=None if done else self._key,
            reward=float(reward),
            done=done,
            truncated=truncated,
            action_valid=valid,
            admissible=() if done else self._commands,
            won=done and bool(info.get(self._won_key, False)),
        )

    @property
    def instructions(self) -> str:
        return self._instructions or GENERIC_INSTRUCTIONS

    def expert_plan(self) -> list[str] | None:
        return None if self._plan is None else list(self._plan)

    @classmethod
    def vocabulary(cls) -> list[str]:
        """Users' environments are not part of the tiny policy's vocabulary (see docs)."""
        return []


def _shape(value: Any) -> str:
    if isinstance(value, tuple):
        return f"a tuple of {len(value)}"
    return f"a {type(value).__name__}"
