"""GEM's environments (`--env gem/game:GuessTheNumber-v0-easy`).

GEM (AxonRL, "a Gym for generalist LLMs") is Gymnasium-shaped: `reset(seed)` returns
`(observation, info)`, `step(action)` the 5-tuple. What it does not give, the adapter
derives, documented in docs/environments.md:

- the game is made with `gem.make(id)`, without GEM's observation wrappers (they add
  the history; here the project's `history_window` decides);
- the reset observation (the game's rules) is the system prompt, kept whatever the
  history window; each later observation ends with GEM's `info["suffix"]`, as GEM's
  own observation wrapper does;
- state key: GEM gives none, so it is the game's own fields (the unwrapped
  environment's public attributes holding plain data, e.g. GuessTheNumber's
  `game_number`, `previous_guesses`, `turn_count`) as sorted-key JSON;
- invalid: a reply GEM cannot parse gets `LanguageGameReward.format_error_reward`
  (-0.1) and ends the episode: such a step is `action_valid = false`. GEM gives its
  other invalid moves (a guess out of range or repeated) `invalid_action_reward`, which
  equals its reward for an ordinary step (0.0), and says so only in words: they count
  as valid here;
- won: the episode terminated with GEM's `success_reward` (1.0);
- `terminated` is `done` even when GEM also sets `truncated` at its own turn limit (the
  game is over either way).
"""

from __future__ import annotations

from typing import Any

from gagpo.envs.base import Reset, Transition
from gagpo.envs.library import LibraryEnv, canonical, import_library, is_data
from gagpo.schemas.errors import GagpoError

PREFIX = "gem/"
_NOT_STATE = frozenset({"env_id", "entry_point"})  # set by gem.make on every env


class GemEnv(LibraryEnv):
    """One GEM environment (see the module docstring)."""

    def __init__(self, env_id: str, *, max_turns: int, **env_options: Any) -> None:
        super().__init__(f"{PREFIX}{env_id}", max_turns)
        gem = import_library("gem")
        from gem.utils.constants import LanguageGameReward

        self._rewards = LanguageGameReward
        try:
            self.env = gem.make(env_id, **env_options)
        except ValueError as exc:
            raise GagpoError(f"environment {self.name!r}: gem says {exc}") from None
        except TypeError as exc:
            raise GagpoError(
                f"environment {self.name!r} cannot take these options: {exc}"
            ) from None
        self._rules = ""
        self._suffix = ""

    def _state_key(self) -> str:
        game = getattr(self.env, "unwrapped", self.env)
        fields = {
            k: v
            for k, v in vars(game).items()
            if not k.startswith("_") and k not in _NOT_STATE and is_data(v)
        }
        return canonical(fields)

    def _text(self, observation: Any) -> str:
        if not isinstance(observation, str):
            raise GagpoError(
                f"environment {self.name!r} returned a {type(observation).__name__} "
                "observation; accepted: GEM's text environments"
            )
        return observation

    def reset(self, task_seed: int) -> Reset:
        observation, info = self.env.reset(seed=task_seed)
        self._rules = self._text(observation)
        self._suffix = str((info or {}).get("suffix", ""))
        self._begin(self._state_key())
        return Reset(self._rules, self._key, None)

    def step(self, reply: str) -> Transition:
        self._check_running()
        observation, reward, terminated, truncated, info = self.env.step(reply)
        observation, reward, done = self._text(observation), float(reward), bool(terminated)
        suffix = str((info or {}).get("suffix", self._suffix))
        if not done and suffix:
            observation = f"{observation}\n{suffix}"
        return self._end_turn(
            observation=observation,
            reward=reward,
            done=done,
            valid=not (done and reward == self._rewards.format_error_reward),
            won=done and reward >= self._rewards.success_reward,
            key=self._state_key(),
            truncated=bool(truncated),
        )

    @property
    def instructions(self) -> str:
        return self._rules or "You are playing a GEM game. Reply with your move."
