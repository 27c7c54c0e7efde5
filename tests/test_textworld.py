"""The TextWorld environment: generated games, users' own game files, expert
walkthroughs, group starts, keys, command matching.

Games are generated once into the cache ($GAGPO_CACHE, kept between `make test` runs);
generating one takes a few seconds (Inform 7 compiles it), so those tests are slow.
Users' games are made here with TextWorld's own `tw-make`, as a user would.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from gagpo.envs import textworld_env
from gagpo.envs.base import INVALID_ACTION_PENALTY, Environment
from gagpo.envs.external import match_command
from gagpo.envs.textworld_env import CHALLENGES, TextWorld, game_settings
from gagpo.schemas.errors import GagpoError
from tests.helpers.actors import run_actors_with
from tests.helpers.textworld import TW_MAKE, needs_textworld, tw_make

PLAYED = ["tw-coin_collector", "tw-treasure_hunter", "tw-cooking", "custom"]


# --- without TextWorld --------------------------------------------------------------------


def test_settings_have_defaults_and_are_checked() -> None:
    assert game_settings("tw-coin_collector", None, None) == {"level": 5}
    assert game_settings("tw-treasure_hunter", 12, None) == {"level": 12}
    assert game_settings("tw-cooking", None, {"go": 6})["go"] == 6
    with pytest.raises(GagpoError, match="unknown TextWorld challenge 'zork'; accepted: tw-coin"):
        TextWorld(challenge="zork")
    with pytest.raises(
        GagpoError, match="unknown setting 'levle' for tw-coin_collector; accepted: level"
    ):
        TextWorld(settings={"levle": 3})
    with pytest.raises(GagpoError, match=r"level must be an integer in \[1, 30\], got 31"):
        TextWorld(challenge="tw-treasure_hunter", level=31)
    with pytest.raises(GagpoError, match="level applies to"):
        TextWorld(challenge="tw-cooking", level=2)
    with pytest.raises(GagpoError, match="max_turns must be at least 1"):
        TextWorld(max_turns=0)
    assert set(PLAYED) <= set(CHALLENGES)


def test_is_an_environment_and_builds_without_textworld(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "textworld", None)  # importing it now fails
    env = TextWorld(max_turns=7)
    assert isinstance(env, Environment) and env.name == "textworld" and env.max_turns == 7
    assert "Reply with exactly one command." in env.instructions
    assert env.expert_plan() is None
    assert {"go", "north", "take", "coin", "inventory", "look"} <= set(TextWorld.vocabulary())
    with pytest.raises(GagpoError, match=r"pip install .*textworld==1\.7\.0"):
        env.reset(0)


def test_replies_match_whatever_their_case_and_keep_the_games_spelling() -> None:
    admissible = ("go east", "take type X latchkey", "examine Henderson's chest")
    assert match_command("Take Type x Latchkey.", admissible) == "take type X latchkey"
    assert match_command("Action: examine the henderson's CHEST", admissible) == admissible[2]
    assert match_command("GO  EAST", admissible) == "go east"
    assert match_command("take type Y latchkey", admissible) is None


def test_user_game_files_are_checked(tmp_path: Path) -> None:
    game = tmp_path / "mine.z8"
    with pytest.raises(GagpoError, match=f"TextWorld game file {game} does not exist"):
        TextWorld(game_files=str(game))
    game.write_bytes(b"z")
    with pytest.raises(GagpoError, match=re.escape(f"{game} has no mine.json beside it; tw-make")):
        TextWorld(game_files=[game])
    (tmp_path / "old.ulx").write_bytes(b"g")
    with pytest.raises(GagpoError, match=re.escape("old.ulx is Glulx (.ulx), which TextWorld 1.7")):
        TextWorld(game_files=str(tmp_path / "old.ulx"))
    with pytest.raises(GagpoError, match=r"not a TextWorld game file; accepted: a \.z8 file"):
        TextWorld(game_files=str(tmp_path / "mine.ni"))
    with pytest.raises(GagpoError, match=r"no TextWorld game files match '.*/nothing-\*.z8'"):
        TextWorld(game_files=str(tmp_path / "nothing-*.z8"))
    with pytest.raises(GagpoError, match="game_files is empty"):
        TextWorld(game_files=[])
    (tmp_path / "mine.json").write_text("{}")
    with pytest.raises(GagpoError, match="challenge, level apply to generated games"):
        TextWorld(game_files=str(game), challenge="tw-cooking", level=2)
    # A glob names the games in order (tw-make's .json and .ni left out); the seed picks one.
    (tmp_path / "old.ulx").unlink()
    (tmp_path / "another.z8").write_bytes(b"z")
    (tmp_path / "another.json").write_text("{}")
    (tmp_path / "another.ni").write_text("")
    env = TextWorld(game_files=str(tmp_path / "*"))
    assert env.games == (tmp_path / "another.z8", game)
    assert env.game_path(3) == tmp_path / "mine.z8"


# --- generated games ----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("challenge", PLAYED)
def test_walkthrough_wins_every_challenge(challenge: str) -> None:
    needs_textworld()
    env = TextWorld(max_turns=60, challenge=challenge)
    first = env.reset(7)
    plan = env.expert_plan()
    assert plan and first.admissible and plan[0] in first.admissible
    assert first.observation.strip() and "score: 0" in first.state_key
    total, key = 0.0, first.state_key
    objective = first.observation.split("\n\n")[0]
    for i, command in enumerate(plan):
        tr = env.step(command)
        assert tr.action_valid and tr.state_key == key and not tr.truncated
        assert tr.done == (i == len(plan) - 1), command
        assert tr.observation.endswith(objective) != tr.done  # restated until the game ends
        total += tr.reward
        key = tr.next_state_key
    assert tr.done and tr.next_state_key is None and tr.admissible == ()
    assert total == env.max_score > 0  # every point the game gives, intermediate ones included
    with pytest.raises(RuntimeError, match="call reset"):
        env.step("look")


@pytest.mark.slow
def test_group_starts_from_one_state_and_meets_states_again() -> None:
    needs_textworld()
    envs = [TextWorld(challenge="tw-coin_collector") for _ in range(3)]
    starts = [env.reset(11) for env in envs]
    assert len({(s.state_key, s.observation, s.admissible) for s in starts}) == 1
    # Same moves, same states, whatever instance plays them; going and coming back returns
    # to the starting state.
    move = starts[0].admissible[0]
    assert move.startswith("go ")
    back = {"north": "south", "south": "north", "east": "west", "west": "east"}[move.split()[1]]
    there = [env.step(move) for env in envs]
    assert (
        len({t.next_state_key for t in there}) == 1
        and there[0].next_state_key != starts[0].state_key
    )
    home = envs[0].step(f"go {back}")
    assert home.next_state_key == starts[0].state_key
    # A fresh reset of a used instance starts over.
    assert envs[1].reset(11) == starts[0]


@pytest.mark.slow
def test_generation_is_deterministic_across_caches(tmp_path: Path) -> None:
    needs_textworld()
    a = TextWorld(challenge="tw-coin_collector", level=3, cache_dir=tmp_path / "a")
    b = TextWorld(challenge="tw-coin_collector", level=3, cache_dir=tmp_path / "b")
    assert a.reset(5) == b.reset(5)
    assert a.expert_plan() == b.expert_plan()
    (game,) = (tmp_path / "a").iterdir()
    assert sorted(p.name for p in game.iterdir()) == [
        "game.json",
        "game.ni",
        "game.z8",
        "meta.json",
    ]
    assert not [p for p in (tmp_path / "a").iterdir() if p.name.startswith(".")]  # no leftovers


@pytest.mark.slow
def test_invalid_replies_change_nothing_and_turns_run_out() -> None:
    needs_textworld()
    env = TextWorld(max_turns=3, challenge="tw-coin_collector")
    first = env.reset(11)
    tr = env.step("dance with the coin")
    assert not tr.action_valid and tr.reward == INVALID_ACTION_PENALTY
    assert (
        tr.next_state_key == tr.state_key == first.state_key and tr.admissible == first.admissible
    )
    assert env.step("Action: LOOK.").action_valid  # decoration and case are ignored
    last = env.step("inventory")
    assert last.truncated and not last.done and last.next_state_key == first.state_key


def test_a_generation_failure_names_the_settings(tmp_path: Path) -> None:
    needs_textworld()
    env = TextWorld(challenge="tw-cooking", settings={"go": 7}, cache_dir=tmp_path)
    with pytest.raises(GagpoError, match=r"could not generate tw-cooking with settings .*'go': 7"):
        env.reset(0)
    assert not list(tmp_path.iterdir())  # the failed build left nothing behind


# --- users' own games, made with tw-make --------------------------------------------------


@pytest.mark.slow
def test_walkthroughs_win_users_tw_make_games() -> None:
    games = [tw_make(name) for name in TW_MAKE]
    env = TextWorld(max_turns=60, game_files=[str(g) for g in games])
    for seed, game in enumerate(games):
        first = env.reset(seed)
        assert env.game_path(seed) == game
        plan = env.expert_plan()
        assert plan and plan[0] in first.admissible and "score: 0" in first.state_key
        if game.stem == "custom-3":  # objects named with capitals; replies in any case
            assert any(c.isupper() for c in "".join(plan))
            plan = [command.lower() for command in plan]
        total = 0.0
        for i, command in enumerate(plan):
            tr = env.step(command)
            assert tr.action_valid and not tr.truncated, (game.name, command)
            assert tr.done == tr.won == (i == len(plan) - 1), (game.name, command)
            total += tr.reward
        assert total == env.max_score > 0


@pytest.mark.slow
def test_walkthrough_commands_the_game_rejects_are_skipped_and_counted(capsys) -> None:
    game = tw_make("cooking-go9-1")
    written = json.loads(game.with_suffix(".json").read_text())["metadata"]["walkthrough"]
    assert written.count("open fridge") == 2  # the second comes when the fridge is open
    textworld_env._PLANS.clear()  # checked once per process: forget other tests' checks
    env = TextWorld(max_turns=60, game_files=str(game))
    env.reset(0)
    plan = env.expert_plan()
    assert env.walkthrough_skipped == ("open fridge",)
    assert len(plan) == len(written) - 1 and plan.count("open fridge") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has 1 command(s) the game rejects" in err[0]
    steps = [env.step(command) for command in plan]
    assert all(t.action_valid for t in steps) and steps[-1].won
    env.reset(0)  # checked once per game file: no second line
    assert env.expert_plan() == plan and not capsys.readouterr().err


@pytest.mark.slow
def test_a_users_game_plays_as_the_generated_one(tmp_path: Path) -> None:
    needs_textworld()
    generated = TextWorld(challenge="tw-coin_collector", level=2, cache_dir=tmp_path)
    first = generated.reset(5)
    users = TextWorld(game_files=generated.game_path(5))
    assert users.reset(0) == first  # observation, state key, admissible commands
    assert users.expert_plan() == generated.expert_plan()
    for command in generated.expert_plan():
        assert users.step(command) == generated.step(command)


# --- through gagpo-actors -----------------------------------------------------------------


def test_actors_name_a_missing_game_file(tmp_path: Path, store_dir: Path) -> None:
    missing = tmp_path / "games" / "mine.z8"
    result = run_actors_with("textworld", store_dir, "--set", f"env_options.game_files={missing}")
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        == f"gagpo-actors: error: TextWorld game file {missing} does not exist"
    )
