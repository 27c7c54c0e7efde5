"""TextArena's single-player games (`--env textarena/TowerOfHanoi-v0`).

TextArena (Guertler et al., 2025) is not Gymnasium-shaped: `reset(num_players, seed)`
returns None, the player's messages come from `get_observation()`, `step(action)`
returns `(done, info)` and the rewards only from `close()`. This adapter plays that
protocol for one player:

- the game is made with `textarena.make(id)` and every default wrapper is taken off
  (its `LLMObservationWrapper` puts the whole history in each observation; here the
  project's `history_window` decides how much history a prompt keeps);
- the game's player prompt (its rules) is the system prompt; each observation is the
  messages the game sent since the last turn, the echo of the reply left out;
- state key: TextArena's `state.game_state` as sorted-key JSON (Tower of Hanoi: the
  towers; hidden values such as GuessTheNumber's target are part of the state);
- invalid: TextArena marks an invalid move by counting it (`state.error_count`, one is
  forgiven by default) or, when it ends the game, by `game_info[0]["invalid_move"]`;
- reward: 0 before the end, then `close()`'s reward of player 0;
- won: derived, TextArena has no flag: the game ended with reward 1 (single-player
  games call `set_outcome(reward=1)` on success, a fraction of completion otherwise)
  and not on an invalid move.

Tower of Hanoi has an expert plan (the recursive solution), used by `--expert` and tests.
"""

from __future__ import annotations

from typing import Any

from gagpo.envs.base import Reset, Transition
from gagpo.envs.library import LibraryEnv, canonical, import_library
from gagpo.schemas.errors import GagpoError

PREFIX = "textarena/"
GENERIC_INSTRUCTIONS = "You are playing a single-player text game. Reply with exactly one move."


def hanoi_moves(disks: int, source: str = "A", spare: str = "B", target: str = "C") -> list[str]:
    """The 2^n - 1 moves that carry `disks` disks from `source` to `target`, as TextArena's
    Tower of Hanoi spells them ("[A C]")."""
    if disks == 0:
        return []
    return [
        *hanoi_moves(disks - 1, source, target, spare),
        f"[{source} {target}]",
        *hanoi_moves(disks - 1, spare, source, target),
    ]


class TextArenaEnv(LibraryEnv):
    """One TextArena single-player game (see the module docstring)."""

    def __init__(self, game: str, *, max_turns: int, **game_options: Any) -> None:
        super().__init__(f"{PREFIX}{game}", max_turns)
        ta = import_library("textarena")
        self._ta = ta
        try:
            env = ta.make(game, **game_options)
        except ValueError as exc:
            raise GagpoError(f"environment {self.name!r}: textarena says {exc}") from None
        except TypeError as exc:  # an option the game's constructor does not take
            raise GagpoError(
                f"environment {self.name!r} cannot take these options: {exc}"
            ) from None
        while isinstance(env, ta.Wrapper):  # the history wrapper and its kin off
            env = env.env
        self.env = env
        self.game = game
        self._prompt = ""
        self._plan: list[str] | None = None

    def _messages(self) -> tuple[str, str]:
        """(player prompt, everything else) the game sent player 0 since the last turn."""
        types = self._ta.ObservationType
        _, messages = self.env.get_observation()
        prompt = [m for _, m, kind in messages if kind == types.PROMPT]
        shown = [m for _, m, kind in messages if kind not in (types.PROMPT, types.PLAYER_ACTION)]
        return "\n".join(prompt), "\n".join(m.strip() for m in shown)

    def _state_key(self) -> str:
        return canonical(getattr(self.env.state, "game_state", None))

    def reset(self, task_seed: int) -> Reset:
        try:
            self.env.reset(num_players=1, seed=task_seed)
        except AssertionError as exc:  # SinglePlayerState asserts num_players == 1 the other way
            raise GagpoError(
                f"environment {self.name!r} is not a single-player game ({exc}); accepted: "
                "TextArena's single-player games (e.g. TowerOfHanoi-v0, LightsOut-v0)"
            ) from None
        prompt, shown = self._messages()
        self._prompt = prompt
        disks = getattr(self.env, "num_disks", None)
        self._plan = hanoi_moves(disks) if self.game.startswith("TowerOfHanoi") and disks else None
        self._begin(self._state_key())
        return Reset(shown or prompt, self._key, None)

    def step(self, reply: str) -> Transition:
        self._check_running()
        done, _info = self.env.step(reply)
        state = self.env.state
        game_info = getattr(state, "game_info", {}).get(0, {})
        valid = getattr(state, "error_count", 0) == 0 and not game_info.get("invalid_move", False)
        _, shown = self._messages()
        reward = 0.0
        if done:
            rewards, _ = self.env.close()
            reward = float((rewards or {}).get(0, 0.0))
            reason = str(game_info.get("reason", "")).strip()  # why it ended: the last word
            shown = "\n".join(part for part in (shown, reason) if part)
        return self._end_turn(
            observation=shown,
            reward=reward,
            done=bool(done),
            valid=valid,
            won=bool(done) and valid and reward >= 1.0,
            key=self._state_key(),
        )

    @property
    def instructions(self) -> str:
        return self._prompt or GENERIC_INSTRUCTIONS

    def expert_plan(self) -> list[str] | None:
        return None if self._plan is None else list(self._plan)
