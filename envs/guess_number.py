"""Guess the number: find a secret whole number in a range, told "higher" or "lower" after
each guess, within a few guesses.

A task seed draws a range [low, high] inside 1..MAX_NUMBER and a secret in it. After a
wrong guess the agent is told whether the secret is higher or lower and, with
`show_range` (the default), the range the secret is still in. Binary search (guessing the
middle of what is left) wins whenever the turns allow ⌈log2(n + 1)⌉ guesses for a range of
n numbers, and otherwise (2^T − 1)/n of the time in T guesses; a guess away from the
middle wins less often. Whether a run of guesses wins
is decided at its end, so which early guesses earned the win is a question of credit
across turns.

The state key is the range still open and the guesses left, e.g. `range 4-11, 3 left`:
every rollout of a group that narrowed the range alike, by any guesses, shares a key,
which is what GAGPO's grouped value proxy needs; the dialogue never enters it. The
best guesses (those keeping the most secrets winnable in the guesses left: the middles
when guesses are short) are a step oracle (base.StepOracle): they depend on the key alone.

Rewards: 1 for the correct guess, 0 for a wrong one, INVALID_ACTION_PENALTY for a reply
with no whole number (the turn is spent, the range unchanged). Numbers stay within
1..MAX_NUMBER, so the `tiny` policy's vocabulary (every environment's command words, in
actors/policies/tiny.py) needs no word the other environments do not already give it.
"""

from __future__ import annotations

import random
import re

from gagpo.envs.base import INVALID_ACTION_PENALTY, Reset, Transition
from gagpo.schemas.errors import GagpoError

MAX_NUMBER = 19  # the largest secret; 1..19 are already words of the tiny vocabulary
WIN_REWARD = 1.0
_NUMBER = re.compile(r"(?<![\w.])-?\d+(?![\w])")
_KEY = re.compile(r"^range (\d+)-(\d+), (\d+) left$")


def winnable(size: int, left: int) -> int:
    """How many of `size` equally likely secrets best play finds with `left` guesses:
    min(size, 2^left − 1) (each guess settles one number and halves the rest)."""
    return max(0, min(size, (1 << max(left, 0)) - 1))


def best_guesses(low: int, high: int, left: int) -> frozenset[int]:
    """The guesses in [low, high] that keep the most secrets winnable with `left` guesses
    (the most wins under the best play after them): with few guesses left, the middles;
    with guesses to spare, every guess that leaves no side too wide. Empty with none left."""
    if left < 1 or high < low:
        return frozenset()

    def after(g: int) -> int:
        return 1 + winnable(g - low, left - 1) + winnable(high - g, left - 1)

    scores = {g: after(g) for g in range(low, high + 1)}
    top = max(scores.values())
    return frozenset(g for g, score in scores.items() if score == top)


def state_key(low: int, high: int, left: int) -> str:
    """The canonical state: the range still open and the guesses left."""
    return f"range {low}-{high}, {left} left"


def parse_key(key: str) -> tuple[int, int, int]:
    """(low, high, guesses left) of a `state_key`: its inverse."""
    match = _KEY.match(key)
    if match is None:
        raise ValueError(f"not a guess-number state key: {key!r}")
    low, high, left = (int(x) for x in match.groups())
    return low, high, left


def parse_guess(reply: str) -> int | None:
    """The first whole number a reply names ("7", "My guess is 7.", "Guess: 12"), or None."""
    match = _NUMBER.search(reply)
    return int(match.group()) if match else None


def draw_task(seed: int, sizes: tuple[int, int]) -> tuple[int, int, int]:
    """(low, high, secret) of a task seed: a range of sizes[0]..sizes[1] numbers placed
    anywhere in 1..MAX_NUMBER, and a secret drawn uniformly in it."""
    rng = random.Random(seed)
    size = rng.randint(*sizes)
    low = rng.randint(1, MAX_NUMBER - size + 1)
    high = low + size - 1
    return low, high, rng.randint(low, high)


def binary_search(low: int, high: int, secret: int) -> list[str]:
    """The guesses of binary search (the lower middle each time) until it names `secret`."""
    plan = []
    while low <= high:
        guess = (low + high) // 2
        plan.append(str(guess))
        if guess == secret:
            break
        low, high = (guess + 1, high) if guess < secret else (low, guess - 1)
    return plan


class GuessNumber:
    """Find the secret number by guesses told "higher" or "lower"; the episode is won on
    naming it and ends, not won, when the guesses run out."""

    name = "guess_number"

    @classmethod
    def optimal_moves(cls, state_key: str) -> frozenset[str]:
        return frozenset(str(g) for g in best_guesses(*parse_key(state_key)))

    @classmethod
    def parse_move(cls, reply: str) -> str | None:
        guess = parse_guess(reply)
        return None if guess is None else str(guess)

    def __init__(
        self, max_turns: int = 4, *, sizes: tuple[int, int] = (8, 15), show_range: bool = True
    ) -> None:
        """`sizes`: the fewest and most numbers a task's range holds (within 1..MAX_NUMBER);
        `show_range`: each observation also says the range the secret is still in (the
        state then needs no history; without it the agent must remember the replies)."""
        if max_turns < 1:
            raise GagpoError(f"max_turns must be at least 1, got {max_turns}")
        sizes = tuple(sizes)
        if len(sizes) != 2 or not 2 <= sizes[0] <= sizes[1] <= MAX_NUMBER:
            raise GagpoError(
                f"guess_number sizes must be [low, high] with 2 <= low <= high <= {MAX_NUMBER}, "
                f"got {list(sizes)}"
            )
        self.max_turns = max_turns
        self.sizes = (int(sizes[0]), int(sizes[1]))
        self.show_range = show_range
        self._task: tuple[int, int, int] | None = None
        self._low = self._high = 0
        self._turn = 0
        self._over = True

    @property
    def secret(self) -> int | None:
        """The current task's secret (None before the first reset)."""
        return self._task[2] if self._task else None

    def _key(self) -> str:
        return state_key(self._low, self._high, self.max_turns - self._turn)

    def _left(self) -> str:
        left = self.max_turns - self._turn
        return f"{left} guess{'' if left == 1 else 'es'} left."

    def reset(self, task_seed: int) -> Reset:
        self._task = draw_task(task_seed, self.sizes)
        self._low, self._high, _ = self._task
        self._turn = 0
        self._over = False
        observation = f"The secret number is between {self._low} and {self._high}. {self._left()}"
        return Reset(observation=observation, state_key=self._key(), admissible=None)

    def step(self, reply: str) -> Transition:
        if self._over or self._task is None:
            raise RuntimeError("the guess_number episode is over (or never began); call reset()")
        before = self._key()
        secret = self._task[2]
        guess = parse_guess(reply)
        self._turn += 1
        done = guess == secret
        if guess is None:
            reward, observation = INVALID_ACTION_PENALTY, "Invalid reply: reply with a number."
        elif done:
            reward, observation = WIN_REWARD, f"{guess} is correct. You win!"
        else:
            reward = 0.0
            if guess < secret:
                self._low = max(self._low, guess + 1)
                observation = f"{guess} is too low: the secret number is higher."
            else:
                self._high = min(self._high, guess - 1)
                observation = f"{guess} is too high: the secret number is lower."
        if not done:
            shown = f" It is between {self._low} and {self._high}." if self.show_range else ""
            observation += f"{shown} {self._left()}"
        truncated = not done and self._turn >= self.max_turns
        self._over = done or truncated
        return Transition(
            observation=observation,
            state_key=before,
            next_state_key=None if done else self._key(),
            reward=reward,
            done=done,
            truncated=truncated,
            action_valid=guess is not None,
            admissible=None,
            won=done,
        )

    @property
    def instructions(self) -> str:
        return (
            "Guess the secret number. After each guess you are told if it is higher or lower. "
            "Reply with the number only (for example: 7). Reply with exactly one command."
        )

    def expert_plan(self) -> list[str] | None:
        """Binary search from the task's start."""
        return binary_search(*self._task) if self._task is not None else None

    def replan(self) -> list[str] | None:
        """Binary search from the range still open."""
        return binary_search(self._low, self._high, self._task[2]) if self._task else None

    @classmethod
    def vocabulary(cls) -> list[str]:
        return [str(n) for n in range(1, MAX_NUMBER + 1)]
