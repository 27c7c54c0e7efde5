"""guess_number follows the environment contract: deterministic tasks, a history-free state
key that rollouts share when they narrow the range alike, the invalid-reply penalty, the
binary-search expert and the step oracle of the best guesses."""

from __future__ import annotations

import random

import pytest

from gagpo.envs import capabilities_of, make_env, step_oracle
from gagpo.envs.base import INVALID_ACTION_PENALTY, Environment
from gagpo.envs.guess_number import (
    MAX_NUMBER,
    GuessNumber,
    best_guesses,
    draw_task,
    parse_guess,
    parse_key,
    winnable,
)
from gagpo.schemas.errors import GagpoError


def play(env: GuessNumber, replies: list[str]) -> list:
    return [env.step(reply) for reply in replies]


def test_same_seed_same_task_and_seeds_differ() -> None:
    a, b = GuessNumber(), GuessNumber()
    assert a.reset(5) == b.reset(5) and a.secret == b.secret
    tasks = {draw_task(seed, (8, 15)) for seed in range(200)}
    assert len(tasks) > 100
    for low, high, secret in tasks:
        assert 1 <= low <= secret <= high <= MAX_NUMBER and 8 <= high - low + 1 <= 15


def test_the_expert_wins_every_task_it_has_the_guesses_for() -> None:
    for seed in range(300):
        env = GuessNumber(max_turns=4)
        env.reset(seed)
        steps = play(env, env.expert_plan())
        assert steps[-1].won and steps[-1].done and steps[-1].reward == 1.0
        assert all(s.action_valid and not s.won for s in steps[:-1])


def test_feedback_narrows_the_range_and_the_key_forgets_the_path() -> None:
    env = make_env("guess_number", 4)
    assert isinstance(env, Environment)
    start = env.reset(3)  # range 9-19, secret 11
    assert (start.state_key, env.secret) == ("range 9-19, 4 left", 11)
    first = env.step("My guess is 15.")
    assert first.observation.startswith("15 is too high: the secret number is lower.")
    assert "between 9 and 14. 3 guesses left." in first.observation
    assert (first.state_key, first.next_state_key) == ("range 9-19, 4 left", "range 9-14, 3 left")
    # Another path to the same range, the same key: guessing 15 again is wasted but valid.
    other = GuessNumber()
    other.reset(3)
    assert other.step("17").next_state_key == "range 9-16, 3 left"
    assert other.step("15").next_state_key == "range 9-14, 2 left"
    assert env.step("15").next_state_key == "range 9-14, 2 left"


def test_an_invalid_reply_costs_the_penalty_and_a_turn_and_truncation_is_not_a_win() -> None:
    env = GuessNumber(max_turns=2)
    env.reset(3)
    bad = env.step("higher, please")
    assert (bad.action_valid, bad.reward, bad.done, bad.truncated) == (
        False,
        INVALID_ACTION_PENALTY,
        False,
        False,
    )
    assert bad.next_state_key == "range 9-19, 1 left"
    last = env.step("9")
    assert last.truncated and not last.done and not last.won and last.reward == 0.0
    with pytest.raises(RuntimeError):
        env.step("10")


def test_hidden_range_says_only_higher_or_lower() -> None:
    env = GuessNumber(show_range=False)
    env.reset(3)
    step = env.step("10")
    assert step.observation == "10 is too low: the secret number is higher. 3 guesses left."
    assert step.next_state_key == "range 11-19, 3 left"  # the key is the state, not the view


@pytest.mark.parametrize(
    ("reply", "guess"),
    [("7", 7), (" 12.", 12), ("My guess is 4", 4), ("**3**", 3), ("Guess: 19", 19), ("x", None)],
)
def test_parse_guess(reply: str, guess: int | None) -> None:
    assert parse_guess(reply) == guess


def test_the_oracle_names_the_guesses_that_keep_most_secrets_winnable() -> None:
    assert step_oracle("guess_number") is GuessNumber
    assert capabilities_of("guess_number").names() == ["step oracle", "replan"]
    assert GuessNumber.optimal_moves("range 1-15, 4 left") == {"8"}
    assert GuessNumber.optimal_moves("range 1-8, 3 left") == {"4", "5"}
    assert GuessNumber.optimal_moves("range 3-3, 0 left") == frozenset()
    assert GuessNumber.parse_move("I guess 8") == "8"
    # Brute force: the best guess's wins, counted by playing every secret, are the most.
    rng = random.Random(0)
    for _ in range(40):
        low = rng.randint(1, 10)
        high, left = rng.randint(low, MAX_NUMBER), rng.randint(1, 4)
        best = best_guesses(low, high, left)
        assert winnable(high - low + 1, left) == max(
            _wins(low, high, left, g) for g in range(low, high + 1)
        )
        assert all(_wins(low, high, left, g) == winnable(high - low + 1, left) for g in best)
    with pytest.raises(ValueError):
        parse_key("9-14")


def _wins(low: int, high: int, left: int, first: int) -> int:
    """Secrets in [low, high] found by guessing `first`, then binary search (the best play)."""
    found = 0
    for secret in range(low, high + 1):
        lo, hi, guess = low, high, first
        for _ in range(left):
            if guess == secret:
                found += 1
                break
            lo, hi = (guess + 1, hi) if guess < secret else (lo, guess - 1)
            guess = (lo + hi) // 2
    return found


def test_replan_resumes_binary_search_from_the_range_left() -> None:
    env = GuessNumber(max_turns=8)
    env.reset(3)
    env.step("19")
    steps = play(env, env.replan())
    assert steps[-1].won


@pytest.mark.parametrize(
    ("options", "message"),
    [({"sizes": [1, 5]}, "sizes must be"), ({"sizes": [8, 20]}, "sizes must be")],
)
def test_bad_options_are_one_line(options: dict, message: str) -> None:
    with pytest.raises(GagpoError, match=message):
        make_env("guess_number", 4, **options)
    with pytest.raises(GagpoError, match="max_turns"):
        GuessNumber(max_turns=0)
