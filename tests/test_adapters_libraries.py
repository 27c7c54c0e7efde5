"""Adapters of ecosystem libraries selected by name: TextArena, GEM and reasoning-gym.

Each runs where its package is installed (`make install` installs the pinned versions;
conftest.py points HOME and TMPDIR at scratch folders for them): expert or scripted
plays are won, invalid replies are flagged, reset(seed) on one instance restores the
seed's episode, and `gagpo-actors --policy tiny` plays each into valid shards.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from gagpo.envs import environment_names, make_env
from gagpo.envs.textarena_env import hanoi_moves
from gagpo.schemas import columns as C
from gagpo.schemas.errors import GagpoError
from tests.helpers.actors import needs


def play(env, replies):
    return [env.step(r) for r in replies]


# -- TextArena ---------------------------------------------------------------------------


@needs("textarena")
@pytest.mark.parametrize("game, disks", [("TowerOfHanoi-v0", 3), ("TowerOfHanoi-v0-medium", 4)])
def test_textarena_tower_of_hanoi_solution_is_won(game, disks):
    env = make_env(f"textarena/{game}", 40)
    first = env.reset(7)
    assert first.state_key == (
        '{"towers":{"A":' + str(list(range(disks, 0, -1))).replace(" ", "") + ',"B":[],"C":[]}}'
    )
    assert "Tower of Hanoi" in env.instructions  # the game's own prompt is the system prompt
    plan = env.expert_plan()
    assert plan == hanoi_moves(disks) and len(plan) == 2**disks - 1
    steps = play(env, plan)
    assert all(t.action_valid for t in steps)
    assert [t.reward for t in steps[:-1]] == [0.0] * (len(steps) - 1)  # rewards come from close()
    assert steps[-1].done and steps[-1].won and steps[-1].reward == 1.0
    assert not any(t.won for t in steps[:-1])
    # the observation is this turn's messages: no history, no echo of the reply
    assert "[A C]" not in steps[3].observation and "You moved disk" in steps[3].observation


@needs("textarena")
def test_textarena_invalid_moves_are_flagged_and_the_second_ends_the_game():
    env = make_env("textarena/TowerOfHanoi-v0", 40)
    start = env.reset(0).state_key
    bad = env.step("move the big one")  # not '[X Y]': TextArena forgives one error
    assert not bad.action_valid and not bad.done and bad.next_state_key == start
    assert "invalid move" in bad.observation
    ok = env.step("[A B]")
    assert ok.action_valid
    illegal = env.step("[A B]")  # disk 2 onto disk 1: a rule violation, counted
    assert not illegal.action_valid and not illegal.done
    ended = env.step("[C A]")  # from an empty tower, the second error in a row
    assert not ended.action_valid and ended.done and not ended.won
    assert "Invalid Move" in ended.observation


@needs("textarena")
def test_textarena_multiplayer_game_and_unknown_game_are_one_line():
    with pytest.raises(GagpoError, match="not a single-player game"):
        make_env("textarena/TicTacToe-v0", 10).reset(0)
    with pytest.raises(GagpoError, match="textarena says") as exc:
        make_env("textarena/NoSuchGame-v0", 10)
    assert "\n" not in str(exc.value)


# -- GEM ---------------------------------------------------------------------------------


def _bisect(env, low: int, high: int):
    """Guess the number by halving the range on GEM's higher/lower hints."""
    steps = []
    while True:
        guess = (low + high) // 2
        t = env.step(f"My guess: \\boxed{{{guess}}}")
        steps.append(t)
        if t.done:
            return steps
        if "higher" in t.observation:
            low = guess + 1
        else:
            high = guess - 1


@needs("gem")
def test_gem_guess_the_number_bisection_is_won_and_a_format_error_is_invalid():
    env = make_env("gem/game:GuessTheNumber-v0-easy", 10)
    won = 0
    for seed in range(8):
        first = env.reset(seed)
        assert '"game_number":' in first.state_key and '"turn_count":0' in first.state_key
        assert "Guess The Number" in env.instructions
        steps = _bisect(env, 1, 10)
        assert all(t.action_valid for t in steps)
        won += steps[-1].won
        assert steps[-1].won == (steps[-1].reward == 1.0)
    assert won == 8  # 4 turns always suffice for 1..10 by halving
    env.reset(0)
    bad = env.step("five")  # GEM's format error: -0.1 and the episode ends
    assert not bad.action_valid and bad.done and not bad.won and bad.reward == pytest.approx(-0.1)
    env.reset(0)
    out_of_range = env.step("\\boxed{99}")  # GEM's invalid_action_reward = its step reward
    assert out_of_range.action_valid and not out_of_range.done  # documented: not told apart


# -- reasoning-gym -----------------------------------------------------------------------


@needs("reasoning_gym")
def test_reasoning_gym_answers_are_scored_by_the_dataset():
    env = make_env("reasoning_gym/leg_counting", 3, size=50, seed=1)
    dataset = env.dataset
    for seed in (0, 7, 57):  # 57 wraps to entry 7
        first = env.reset(seed)
        assert "legs" in first.observation and first.state_key == first.observation
        right = env.step(env.expert_plan()[0])
        assert right.won and right.reward == 1.0 and right.done and right.next_state_key is None
    assert env.dataset is dataset  # built once, not per rollout
    env.reset(3)
    wrong = env.step("-1")
    assert wrong.action_valid and not wrong.won and wrong.reward < 1.0
    env.reset(3)
    empty = env.step("   ")
    assert not empty.action_valid and not empty.won
    with pytest.raises(GagpoError, match="reasoning-gym says"):
        make_env("reasoning_gym/no_such_dataset", 3)


# -- the reset(seed) contract ------------------------------------------------------------

RESET_CASES = [
    pytest.param("textarena/GuessTheNumber-v0", {}, "[5]", marks=needs("textarena")),
    pytest.param("textarena/LightsOut-v0", {}, "[0 0]", marks=needs("textarena")),
    pytest.param("gem/game:GuessTheNumber-v0-hard", {}, "\\boxed{5}", marks=needs("gem")),
    pytest.param("reasoning_gym/leg_counting", {"size": 100}, "12", marks=needs("reasoning_gym")),
]


@pytest.mark.parametrize("name, options, reply", RESET_CASES)
def test_one_instance_reset_per_rollout_restores_each_seed(name, options, reply):
    """An environment is built once per slot and reset per rollout: seed a, then b, then
    a again on the same instance (with moves played in between) give a's first
    observation and state key again, and b's differ from a's."""
    env = make_env(name, 5, **options)
    a = env.reset(11)
    env.step(reply)
    b = env.reset(12)
    env.step(reply)
    env.step(reply) if not env._over else None
    again = env.reset(11)
    assert (again.observation, again.state_key) == (a.observation, a.state_key)
    assert b.state_key != a.state_key
    fresh = make_env(name, 5, **options).reset(11)  # and a new instance agrees
    assert (fresh.observation, fresh.state_key) == (a.observation, a.state_key)


def test_families_are_listed_and_an_empty_name_is_unknown():
    names = environment_names()
    assert {"textarena/<game>", "gem/<env id>", "reasoning_gym/<dataset>"} <= set(names)
    assert "openenv+http://HOST:PORT" in names
    with pytest.raises(GagpoError, match="unknown environment 'textarena/'"):
        make_env("textarena/", 3)


# -- into shards (the tiny policy's: tests/test_actors_cli.py) -----------------------------

ACTORS = [sys.executable, "-m", "gagpo.actors.cli", "--quiet"]


@pytest.mark.slow
@needs("textarena")
def test_expert_demonstrations_of_tower_of_hanoi_are_won_in_shards(store_dir: Path):
    result = subprocess.run(
        [
            *ACTORS,
            "--store",
            str(store_dir),
            "--env",
            "textarena/TowerOfHanoi-v0",
            "--policy",
            "tiny",
            "--expert",
            "--groups",
            "2",
            "--group-size",
            "2",
            "--max-turns",
            "10",
            "--seed",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    steps = pl.read_parquet(sorted(store_dir.glob("shards/run=*/*.parquet")))
    last = steps.filter(pl.col(C.DONE))
    assert last.height == 4 and last[C.WON].all()
    assert steps[C.ACTION_VALID].all()
    assert set(steps[C.ACTION_TEXT]) == {m for m in hanoi_moves(3)}
    assert re.fullmatch(r"\{.*\}", steps[C.STATE_KEY][0])
