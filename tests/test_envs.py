"""The built-in environments: determinism, expert plans, validity, keys, the registry."""

from __future__ import annotations

import copy
import random
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from gagpo.envs import ENVIRONMENTS, capabilities_of, make_env, step_oracle
from gagpo.envs.base import INVALID_ACTION_PENALTY, Capabilities, Environment, capabilities
from gagpo.envs.household import GOAL_KINDS, Household
from gagpo.envs.parse import normalise_command
from gagpo.envs.sokoban import MOVES, Sokoban, generate, parse_grid, render
from gagpo.schemas.errors import GagpoError

ROOT = Path(__file__).resolve().parents[1]
SEEDS = range(120)


def _seeds_by_goal_kind(per_kind: int) -> dict[str, list[int]]:
    found: dict[str, list[int]] = defaultdict(list)
    env = Household()
    seed = 0
    while any(len(found[k]) < per_kind for k in GOAL_KINDS):
        env.reset(seed)
        assert env.goal is not None
        found[env.goal.kind].append(seed)
        seed += 1
    return found


def _random_walk(env: Environment, seed: int, steps: int, rng: random.Random) -> list:
    """Transitions of a walk over admissible actions (Sokoban: moves) until the end."""
    first = env.reset(seed)
    admissible, out = first.admissible, []
    for _ in range(steps):
        assert admissible
        tr = env.step(rng.choice(admissible))
        out.append(tr)
        if tr.done or tr.truncated:
            break
        admissible = tr.admissible
    return out


# --- parsing ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ("  Go To Cabinet 1. ", "go to cabinet 1"),
        ("Action: go to cabinet 1", "go to cabinet 1"),
        ("I should look first.\nAction: `look`", "look"),
        ("> take  mug 1 from\tcountertop 2!", "take mug 1 from countertop 2"),
        ('"up"', "up"),
        ("**Right**\n\nbecause the box is there", "right"),
        ("", ""),
    ],
)
def test_normalise_command(reply: str, expected: str) -> None:
    assert normalise_command(reply) == expected


def test_sokoban_accepts_move_variants_and_rejects_the_rest() -> None:
    for reply in ("UP", " up. ", "Move up", "Action: move up", "go up"):
        env = Sokoban()
        env.reset(3)
        assert env.step(reply).action_valid, reply
    for reply in ("jump", "upward", "up left", "north", ""):
        env = Sokoban()
        env.reset(3)
        assert not env.step(reply).action_valid, reply


def test_household_accepts_aliases_of_put() -> None:
    env = Household()
    env.reset(0)
    plan = env.expert_plan()
    assert plan is not None
    for command in plan[:-1]:
        env.step(command)
    last = plan[-1]
    assert last.startswith("put ") and " in/on " in last
    tr = env.step("Action: Put the " + last[len("put ") :].replace(" in/on ", " on the ") + ".")
    assert tr.action_valid and tr.done


# --- determinism -----------------------------------------------------------------------


@pytest.mark.parametrize("cls", [Sokoban, Household])
def test_same_seed_same_episode(cls: type) -> None:
    for seed in range(20):
        a, b = cls(), cls()
        first_a, first_b = a.reset(seed), b.reset(seed)
        assert first_a == first_b
        assert a.expert_plan() == b.expert_plan()
        walk_a = _random_walk(a, seed, 25, random.Random(seed))
        walk_b = _random_walk(b, seed, 25, random.Random(seed))
        assert walk_a == walk_b


@pytest.mark.parametrize("cls", [Sokoban, Household])
def test_different_seeds_give_different_tasks(cls: type) -> None:
    env = cls()
    starts = {env.reset(seed).observation for seed in range(100)}
    assert len(starts) == 100


def test_reset_restarts_the_task() -> None:
    env = Household()
    first = env.reset(7)
    env.step("go to fridge 1")
    assert env.reset(7) == first


# --- expert plans ----------------------------------------------------------------------


def test_sokoban_expert_solves_every_seed() -> None:
    env = Sokoban()
    box_counts = set()
    for seed in SEEDS:
        first = env.reset(seed)
        box_counts.add(first.state_key.count("$") + first.state_key.count("*"))
        plan = env.expert_plan()
        assert plan and len(plan) >= 3
        for i, move in enumerate(plan):
            tr = env.step(move)
            assert tr.action_valid
            assert tr.done == tr.won == (i == len(plan) - 1), (seed, i)
        # The last push puts the last box on its target: step cost + box reward + bonus.
        assert tr.reward == pytest.approx(-0.1 + 1.0 + 10.0)
        assert tr.next_state_key is None
    assert box_counts == {1, 2}


def test_household_expert_solves_every_goal_kind() -> None:
    for kind, seeds in _seeds_by_goal_kind(per_kind=25).items():
        for seed in seeds:
            env = Household()
            first = env.reset(seed)
            assert "Your task is to:" in first.observation
            plan = env.expert_plan()
            assert plan
            admissible = first.admissible
            for i, command in enumerate(plan):
                assert admissible is not None and command in admissible
                tr = env.step(command)
                admissible = tr.admissible
                assert tr.action_valid, (kind, seed, command)
                assert tr.done == tr.won == (i == len(plan) - 1), (kind, seed, i)
                assert tr.reward == (1.0 if tr.done else 0.0)
            assert tr.next_state_key is None and tr.admissible == ()


def test_household_small_room_and_goal_kinds() -> None:
    """`room = "small"`: the eight receptacles of one type each, 2–4 distractors; `goals`
    restricts the kinds drawn; the expert solves every such task; the full room is unchanged."""
    env = Household(room="small", goals=["pick_place", "heat"])
    kinds = set()
    for seed in range(60):
        env.reset(seed)
        layout = env._layout
        assert len(layout.receptacles) == 8
        assert len({r.rsplit(" ", 1)[0] for r in layout.receptacles}) == 8
        assert 3 <= len(layout.objects) <= 5  # the goal object and 2–4 others
        kinds.add(env.goal.kind)
        for command in env.expert_plan():
            tr = env.step(command)
        assert tr.won
    assert kinds == {"pick_place", "heat"}
    full, default = Household(room="full"), Household()
    for seed in range(20):  # the default draws the same tasks as before these options
        assert full.reset(seed) == default.reset(seed)
    sizes = set()
    for seed in range(40):
        default.reset(seed)
        sizes.add(len(default._layout.receptacles))
    assert sizes == {11, 12, 13, 14, 15, 16, 18}  # the full room varies


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"room": "huge"}, "household room 'huge' not accepted; accepted: full, small"),
        (
            {"goals": ["fly"]},
            r"household goals \['fly'\] not accepted; accepted: one or more of pick_place",
        ),
        ({"goals": []}, "household goals"),
    ],
)
def test_household_rejects_unknown_options(options, message) -> None:
    with pytest.raises(GagpoError, match=message):
        Household(**options)


def test_household_restates_the_task_every_turn() -> None:
    """The goal stays in every observation (the prompt keeps only `history_window` earlier
    turns), valid or not, and is not repeated once the task is done."""
    env = Household(room="small")
    env.reset(4)
    task = f"Your task is to: {env.goal.text}"
    plan = env.expert_plan()
    assert env.step("xyzzy").observation.endswith(task)
    for command in plan[:-1]:
        assert env.step(command).observation.endswith(task)
    assert task not in env.step(plan[-1]).observation


# --- invalid actions, truncation, terminal steps ---------------------------------------


def test_invalid_replies_cost_a_penalty_and_change_nothing() -> None:
    for env, reply in [
        (Sokoban(), "dance"),
        (Household(), "fly to the moon"),
        (Household(), "take mug 1 from cabinet 1"),  # nothing is reachable from the start
    ]:
        first = env.reset(11)
        tr = env.step(reply)
        assert not tr.action_valid
        assert tr.reward == INVALID_ACTION_PENALTY
        assert tr.state_key == tr.next_state_key == first.state_key
        assert tr.admissible == first.admissible
        assert not tr.done and not tr.truncated
    assert tr.observation == f"Nothing happens.\n\nYour task is to: {env.goal.text}"


def test_sokoban_wall_bump_is_a_valid_noop() -> None:
    env = Sokoban()
    first = env.reset(0)
    # walk left until a wall stops us; every step is valid and costs the step penalty
    for _ in range(len(first.state_key.splitlines()[0])):
        tr = env.step("left")
        assert tr.action_valid and not tr.done
        if tr.state_key == tr.next_state_key:
            assert tr.reward == pytest.approx(-0.1)
            return
    pytest.fail("walking left never hit a wall")


@pytest.mark.parametrize("cls", [Sokoban, Household])
def test_truncation_at_max_turns(cls: type) -> None:
    env = cls(max_turns=3)
    env.reset(5)
    replies = ["look", "inventory", "look"] if cls is Household else ["xyzzy"] * 3
    transitions = [env.step(reply) for reply in replies]
    assert [t.truncated for t in transitions] == [False, False, True]
    assert transitions[-1].next_state_key is not None
    assert not transitions[-1].done and not any(t.won for t in transitions)
    with pytest.raises(RuntimeError, match="reset"):
        env.step(replies[0])


@pytest.mark.parametrize("cls", [Sokoban, Household])
def test_terminal_step_has_no_next_state_and_ends_the_episode(cls: type) -> None:
    env = cls(max_turns=100)
    env.reset(9)
    plan = env.expert_plan()
    assert plan is not None
    for command in plan:
        tr = env.step(command)
    assert tr.done and not tr.truncated and tr.next_state_key is None
    with pytest.raises(RuntimeError, match="reset"):
        env.step(plan[0])


@pytest.mark.parametrize("cls", [Sokoban, Household])
def test_step_before_reset_raises(cls: type) -> None:
    with pytest.raises(RuntimeError, match="reset"):
        cls().step("look")


def test_sokoban_rewards_match_boxes_on_targets() -> None:
    rng = random.Random(0)
    for seed in range(40):
        for tr in _random_walk(Sokoban(), seed, 30, rng):
            if not tr.action_valid:
                continue
            after = tr.next_state_key or ""
            change = after.count("*") - tr.state_key.count("*")
            if tr.done:  # no grid after the end: the move put the last box on a target
                change = 1
            expected = -0.1 + change + (10.0 if tr.done else 0.0)
            assert tr.reward == pytest.approx(expected)


# --- state keys ------------------------------------------------------------------------


def _boxes_only(grid: str) -> str:
    return grid.replace("@", "_").replace("+", ".")


def test_sokoban_key_returns_after_a_move_and_its_reverse() -> None:
    opposite = {"up": "down", "down": "up", "left": "right", "right": "left"}
    checked = 0
    for seed in range(30):
        for move in MOVES:
            env = Sokoban()
            start = env.reset(seed).state_key
            there = env.step(move).next_state_key
            assert there is not None
            if there == start or _boxes_only(there) != _boxes_only(start):
                continue  # blocked, or a box moved: the reverse move does not undo it
            assert env.step(opposite[move]).next_state_key == start
            checked += 1
    assert checked == 73


def test_household_keys_ignore_history() -> None:
    env = Household()
    env.reset(2)
    receptacle = "fridge 1"  # every household has one, closed at the start
    arrived = env.step(f"go to {receptacle}").next_state_key
    opened = env.step(f"open {receptacle}")
    closed = env.step(f"close {receptacle}")
    assert opened.next_state_key != arrived
    assert closed.next_state_key == arrived
    # a detour through another receptacle ends in the same state as going straight there
    other = Household()
    other.reset(2)
    other.step("go to sinkbasin 1")
    other.step("look")
    assert other.step(f"go to {receptacle}").next_state_key == arrived


# --- admissible actions and vocabulary -------------------------------------------------


def test_household_admissible_actions_are_all_valid() -> None:
    rng = random.Random(1)
    for seed in range(12):
        env = Household(max_turns=1000)
        tr = env.reset(seed)
        for _ in range(15):
            assert tr.admissible
            for command in tr.admissible:
                probe = copy.deepcopy(env)
                assert probe.step(command).action_valid, (seed, command)
            tr = env.step(rng.choice(tr.admissible))
            if tr.done:
                break


def test_household_rejects_grammatical_commands_outside_the_list() -> None:
    env = Household(max_turns=1000)
    first = env.reset(4)
    receptacles = [c[len("go to ") :] for c in first.admissible or () if c.startswith("go to ")]
    assert env.step(f"go to {receptacles[0]}").action_valid
    assert not env.step(f"go to {receptacles[0]}").action_valid  # already there
    assert not env.step("put mug 1 in/on cabinet 1").action_valid  # holding nothing
    assert not env.step(f"examine {receptacles[1]}").action_valid  # not there
    assert not env.step("use desklamp 2").action_valid  # no such lamp


@pytest.mark.parametrize("cls", [Sokoban, Household])
def test_vocabulary_covers_every_command(cls: type) -> None:
    vocabulary = cls.vocabulary()
    assert vocabulary == cls.vocabulary() and len(set(vocabulary)) == len(vocabulary)
    words = set(vocabulary)
    rng = random.Random(2)
    for seed in range(60):
        env = cls(max_turns=1000)
        commands = set(env.reset(seed).admissible or ())
        commands |= set(env.expert_plan() or ())
        for tr in _random_walk(env, seed, 30, rng):
            commands |= set(tr.admissible or ())
        for command in commands:
            assert set(command.split()) <= words, command


# --- registry --------------------------------------------------------------------------


def test_registry_builds_each_environment() -> None:
    assert set(ENVIRONMENTS) >= {"household", "sokoban"}
    for name, cls in ENVIRONMENTS.items():
        env = make_env(name, max_turns=7)
        assert isinstance(env, cls) and isinstance(env, Environment)
        assert env.name == name and env.max_turns == 7
        assert "Reply with exactly one command." in env.instructions


def test_built_ins_are_entry_points_imported_on_use() -> None:
    """The built-in environments are this distribution's entry points of `gagpo.envs`, like
    any plugin's; importing the registry imports none of their modules."""
    from importlib.metadata import entry_points

    ours = {
        ep.name: ep.value
        for ep in entry_points(group="gagpo.envs")
        if ep.dist is not None and ep.dist.name == "gagpo"
    }
    assert sorted(ours) == list(ENVIRONMENTS)
    assert ours["sokoban"] == "gagpo.envs.sokoban:Sokoban"
    probe = (
        "import sys, gagpo.envs; "
        "print(sorted(m for m in sys.modules if m.split('.')[-1] in "
        "('sokoban', 'household', 'webshop', 'textworld_env', 'alfworld_env')))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _documented_capabilities() -> dict[str, list[str]]:
    """The table "The built-in ones declare" of docs/environments.md."""
    text = (ROOT / "docs" / "environments.md").read_text()
    table = text.split("The built-in ones declare:", 1)[1].split("\n\n", 2)[1]
    rows = [line.split("|")[1:3] for line in table.splitlines()[2:]]
    return {
        name.strip().strip("`"): [c.strip() for c in caps.split(",") if c.strip()]
        for name, caps in rows
    }


def test_capabilities_are_declared_as_documented() -> None:
    documented = _documented_capabilities()
    assert sorted(documented) == list(ENVIRONMENTS)
    for name in ENVIRONMENTS:
        assert capabilities_of(name).names() == documented[name], name
    assert step_oracle("sokoban") is Sokoban
    assert step_oracle("household") is None and step_oracle("no-such-env") is None


def test_capabilities_of_a_plain_class_and_a_locked_one() -> None:
    class Plain:
        pass

    class Locked:
        thread_safe = False

        def replan(self) -> list[str] | None:
            return None

    assert capabilities(Plain) == Capabilities(step_oracle=False, replan=False, thread_safe=True)
    assert capabilities(Locked()) == Capabilities(step_oracle=False, replan=True, thread_safe=False)
    assert capabilities(Sokoban(max_turns=3)).names() == ["step oracle", "replan"]


def test_unknown_environment_is_a_gagpo_error() -> None:
    with pytest.raises(
        GagpoError, match=r"unknown environment 'foo'; accepted: .*household, sokoban"
    ):
        make_env("foo", max_turns=5)


@pytest.mark.parametrize("cls", [Sokoban, Household])
def test_bad_max_turns_is_a_gagpo_error(cls: type) -> None:
    with pytest.raises(GagpoError, match="max_turns"):
        cls(max_turns=0)


def test_env_options_are_passed_and_unknown_ones_named():
    from gagpo.envs import make_env

    env = make_env("sokoban", 5, max_boxes=1)
    assert env.max_turns == 5
    with pytest.raises(GagpoError, match="takes no option 'colour'; accepted: sizes, max_boxes"):
        make_env("sokoban", 5, colour="red")


def test_sokoban_describe_says_in_words_what_the_grid_shows():
    plain = Sokoban(10, sizes=(5, 5), max_boxes=1)
    worded = Sokoban(10, sizes=(5, 5), max_boxes=1, describe=True)
    a, b = plain.reset(3), worded.reset(3)
    assert a.state_key == b.state_key  # the description never changes the state
    assert b.observation.startswith(a.observation)
    # seed 3: the player at row 3, column 1; the box at row 2, column 3; the target below it
    assert a.state_key.splitlines()[3][1] == "@" and a.state_key.splitlines()[2][3] == "$"
    assert b.observation.splitlines()[-3:] == [
        "up: floor. down: wall. left: wall. right: floor.",
        "box: up 1 right 2.",
        "target from box: down 1.",
    ]
    t = worded.step("up")
    assert t.observation.splitlines()[-2:] == ["box: right 2.", "target from box: down 1."]
    assert t.next_state_key == plain.step("up").next_state_key


def test_sokoban_grid_parses_back_to_its_level() -> None:
    for seed in range(50):
        level, _ = generate(seed, (6, 7), 2)
        assert parse_grid(render(level)) == level
    on_target = parse_grid("#####\n#+*$#\n#####")  # player and one box on targets
    assert on_target.player == 6 and on_target.targets == {6, 7} and on_target.boxes == {7, 8}
    for bad in ("###\n#@", "#?@#", "#__#\n#__#"):  # ragged, unknown cell, no player
        with pytest.raises(ValueError):
            parse_grid(bad)
