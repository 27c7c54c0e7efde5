"""ALFWorld's text engine on generated PDDL problems and on game files in a folder.

Playing needs the `alfworld` package and its engine (TextWorld, Fast Downward); those
tests skip without it. Problem generation and the missing-files error do not.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import polars as pl
import pytest

from gagpo.actors.envs.alfworld_env import ALFWorld, official_games
from gagpo.actors.envs.base import INVALID_ACTION_PENALTY, Environment
from gagpo.actors.envs.pddl_gen import SCENES, TASK_TYPES, Knowledge, generate_task
from gagpo.schemas import columns as C
from gagpo.schemas.errors import GagpoError
from tests.test_textworld import check_shards, run_actors_with


def needs_alfworld() -> None:
    for module in ("alfworld", "textworld", "fast_downward"):
        pytest.importorskip(module, reason="ALFWorld's engine is not installed")


@pytest.fixture(scope="module")
def kb() -> Knowledge:
    needs_alfworld()
    return Knowledge.from_alfworld()


# --- without the engine -------------------------------------------------------------------


def toy_knowledge() -> Knowledge:
    """A hand-made world: every receptacle holds everything, everything can be treated."""
    kinds = {o for s in SCENES.values() for o in s.objects} | {"DeskLamp"}
    receptacles = {r for s in SCENES.values() for r in s.receptacles}
    goal = "(:goal (and (holds agent1 {obj}) (inReceptacle {obj} {recep}) (isOn {toggle})))\n)"
    treatable = frozenset(kinds - {"DeskLamp"})
    properties = {p: treatable for p in ("cleanable", "heatable", "coolable", "sliceable")}
    return Knowledge(
        can_contain={r: treatable for r in receptacles},
        properties={**properties, "toggleable": frozenset({"DeskLamp"})},
        openable=frozenset({"Cabinet", "Drawer", "Fridge", "Microwave"}),
        receptacle_objects=frozenset({"Mug", "Bowl"}),
        goals={t: (goal, ("do {obj} {recep} {toggle}",)) for t in TASK_TYPES},
    )


@pytest.mark.parametrize("task_type", TASK_TYPES)
def test_generated_problems_are_deterministic_and_well_formed(task_type: str) -> None:
    kb = toy_knowledge()
    tasks = [generate_task(seed, task_type, kb) for seed in range(20)]
    assert tasks == [generate_task(seed, task_type, kb) for seed in range(20)]
    assert len({t.problem for t in tasks}) == 20  # seeds give different tasks
    for task in tasks:
        text = task.problem
        assert text.count("(") == text.count(")") and text.startswith("(define")
        assert "(atLocation agent1 loc_bar_0)" in text and "SinkBasinType - rtype" in text
        if task_type == "look_at_obj_in_light":
            assert task.toggle == "DeskLamp" and "(toggleable DeskLamp_bar_1)" in text
            assert task.scene in ("livingroom", "bedroom")
        else:
            # The goal is not met at the start: no goal object is in a target receptacle.
            obj_ids = re.findall(rf"\(inReceptacle ({task.obj}_bar_\d+) (\S+)\)", text)
            assert obj_ids and all(not r.startswith(f"{task.recep}_bar_") for _, r in obj_ids)
            assert len(obj_ids) >= (2 if task_type == "pick_two_obj_and_place" else 1)
        if task_type in ("pick_heat_then_place_in_recep", "pick_cool_then_place_in_recep"):
            assert task.scene == "kitchen"


def test_is_an_environment_and_builds_without_alfworld(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "alfworld", None)
    env = ALFWorld(max_turns=7)
    assert isinstance(env, Environment) and env.name == "alfworld" and env.max_turns == 7
    assert "Reply with exactly one command." in env.instructions
    assert env.expert_plan() is None
    words = set(ALFWorld.vocabulary())
    assert {"go", "to", "move", "heat", "sinkbasin", "desklamp", "countertop", "apple"} <= words
    with pytest.raises(GagpoError, match=r"pip install .*alfworld==0\.4\.2"):
        env.reset(0)
    with pytest.raises(GagpoError, match="unknown ALFWorld task types"):
        ALFWorld(task_types=["pick_and_juggle"])


def test_missing_game_files_name_the_folder(tmp_path: Path) -> None:
    missing = tmp_path / "json_2.1.1" / "train"
    with pytest.raises(
        GagpoError,
        match=f"no ALFWorld game files .* under {re.escape(str(missing))}; .*alfworld-download",
    ):
        ALFWorld(data_dir=missing).reset(0)
    missing.mkdir(parents=True)  # there, but empty
    with pytest.raises(GagpoError, match=re.escape(str(missing))):
        ALFWorld(data_dir=missing).reset(0)


# --- with the engine ----------------------------------------------------------------------


def test_scene_types_exist_in_alfred(kb: Knowledge) -> None:
    import alfworld.gen.constants as constants

    known = set(constants.OBJECTS) | set(constants.RECEPTACLES)
    for scene in SCENES.values():
        assert set(scene.receptacles) <= known and set(scene.objects) <= known
        for obj in scene.objects:  # every object has somewhere to be in its room
            assert any(obj in kb.can_contain.get(r, ()) for r in scene.receptacles), obj


@pytest.mark.slow
@pytest.mark.parametrize("task_type", TASK_TYPES)
def test_expert_plan_solves_generated_tasks_of_every_type(task_type: str) -> None:
    needs_alfworld()
    for seed in (0, 1):
        env = ALFWorld(task_types=[task_type])
        first = env.reset(seed)
        assert "Your task is to:" in first.observation and "Welcome" not in first.observation
        assert "help" not in first.admissible and "look" in first.admissible
        plan = env.expert_plan()
        assert plan and plan[0] in first.admissible
        key = first.state_key
        for i, command in enumerate(plan):
            tr = env.step(command)
            assert tr.action_valid and tr.state_key == key
            assert tr.reward == (1.0 if tr.done else 0.0) and tr.done == (i == len(plan) - 1)
            key = tr.next_state_key
        assert tr.done and tr.next_state_key is None and tr.admissible == ()


@pytest.mark.slow
def test_group_starts_from_one_state_and_meets_states_again() -> None:
    needs_alfworld()
    envs = [ALFWorld(task_types=["pick_and_place_simple"]) for _ in range(3)]
    starts = [env.reset(3) for env in envs]
    assert len({(s.state_key, s.observation, s.admissible) for s in starts}) == 1
    go = next(c for c in starts[0].admissible if c.startswith("go to "))
    other = next(c for c in starts[0].admissible if c.startswith("go to ") and c != go)
    after = [env.step(go).next_state_key for env in envs]
    assert len(set(after)) == 1 and after[0] != starts[0].state_key
    # Looking and examining change no state; going elsewhere and back meets the same key.
    assert envs[0].step("look").next_state_key == after[0]
    envs[1].step(other)
    assert envs[1].step(go).next_state_key == after[0]
    for env in envs:
        env.close()
    assert ALFWorld(task_types=["pick_and_place_simple"]).reset(3) == starts[0]


@pytest.mark.slow
def test_invalid_replies_change_nothing_and_put_is_move() -> None:
    needs_alfworld()
    env = ALFWorld(max_turns=30, task_types=["pick_and_place_simple"])
    first = env.reset(5)
    tr = env.step("fly to the moon")
    assert not tr.action_valid and tr.reward == INVALID_ACTION_PENALTY
    assert tr.next_state_key == first.state_key and tr.admissible == first.admissible
    plan = env.expert_plan()
    for command in plan[:-1]:
        env.step(f"Action: {command.capitalize()}.")
    obj, target = re.fullmatch(r"move (.+) to (.+)", plan[-1]).groups()
    last = env.step(f"put {obj} in/on {target}")  # the older ALFWorld spelling
    assert last.action_valid and last.done and last.reward == 1.0


@pytest.mark.slow
def test_plays_game_files_from_a_folder(tmp_path: Path) -> None:
    needs_alfworld()
    # An ALFWorld-layout folder: <task>-<obj>-...-<scene>/<trial>/game.tw-pddl, one game
    # without a stored plan (the planner makes it) and one that ALFWorld would skip.
    source = ALFWorld(task_types=["pick_heat_then_place_in_recep"])
    source.reset(2)
    game = json.loads(source.game_path(2).read_text())
    del game["walkthrough"]
    root = tmp_path / "json_2.1.1" / "train"
    trial = root / "pick_heat_then_place_in_recep-Cup-None-CounterTop-7" / "trial_T2019_1"
    trial.mkdir(parents=True)
    (trial / "game.tw-pddl").write_text(json.dumps(game))
    skipped = root / "pick_and_place_with_movable_recep-Cup-Pan-Shelf-7" / "trial_T2019_2"
    shutil.copytree(trial, skipped)
    assert official_games(root, TASK_TYPES) == [trial / "game.tw-pddl"]

    env = ALFWorld(data_dir=root)
    first = env.reset(123)  # any seed picks one of the folder's games
    assert first.state_key == source.reset(2).state_key
    plan = env.expert_plan()
    assert plan == source.expert_plan()
    for command in plan:
        tr = env.step(command)
    assert tr.done and tr.reward == 1.0
    with pytest.raises(GagpoError, match=r"no ALFWorld game files .* of task types look_at"):
        ALFWorld(data_dir=root, task_types=["look_at_obj_in_light"]).reset(0)


@pytest.mark.slow
def test_actors_write_valid_alfworld_shards(store_dir: Path) -> None:
    needs_alfworld()
    result = run_actors_with("alfworld", store_dir, "--groups", "2",
                             "--group-size", "2", "--max-turns", "3", "--seed", "3")  # fmt: skip
    assert result.returncode == 0, result.stderr
    steps = check_shards(store_dir, "alfworld", groups=2, group_size=2)
    assert steps[C.REWARD].cast(pl.Float64).round(4).is_in([0.0, 1.0, INVALID_ACTION_PENALTY]).all()
