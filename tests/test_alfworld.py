"""ALFWorld's text engine on generated PDDL problems and on game files in a folder.

Playing needs the `alfworld` package and its engine (TextWorld, Fast Downward); those
tests skip without it. Problem generation and the data_dir errors do not.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest

from gagpo.envs.alfworld_data import find_games, scan
from gagpo.envs.alfworld_env import ALFWorld
from gagpo.envs.base import INVALID_ACTION_PENALTY, Environment
from gagpo.envs.pddl_gen import SCENES, TASK_TYPES, Knowledge, generate_task
from gagpo.schemas.errors import GagpoError
from tests.helpers.actors import run_actors_with


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


# A task of ALFWorld's layout: <task type>-<objects>-<scene>/<trial>/{game.tw-pddl, traj_data.json}.
GOAL = "(:goal (and (holds agent1 Apple_bar_1)))"
PROBLEM = f"(define (problem plan)\n(:domain alfred)\n(:init)\n{GOAL}\n)"


def game_json(**changes: object) -> str:
    data = {
        "pddl_domain": "(define (domain alfred))",
        "grammar": "{}",
        "pddl_problem": PROBLEM,
        "solvable": True,
        **changes,
    }
    return json.dumps({k: v for k, v in data.items() if v is not None})


def make_trial(
    root: Path,
    folder: str = "pick_and_place_simple-Apple-None-Fridge-1",
    *,
    game: str | None = None,
    task_type: str | None = None,
    trial: str = "trial_T1",
) -> Path:
    """A trial folder under `root`; `game` None writes the default game file, "" none."""
    path = root / folder / trial
    path.mkdir(parents=True)
    if game != "":
        (path / "game.tw-pddl").write_text(game_json() if game is None else game)
    if task_type is not None:
        (path / "traj_data.json").write_text(json.dumps({"task_type": task_type}))
    return path


def actors_error(data_dir: Path, store: Path, *task_types: str) -> str:
    """The one line `gagpo-actors` prints for `data_dir`, checked to exit with code 2."""
    sets = ["--set", f"env_options.data_dir={data_dir}"]
    if task_types:
        sets += ["--set", f"env_options.task_types={json.dumps(list(task_types))}"]
    result = run_actors_with("alfworld", store, "--groups", "1", *sets)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gagpo-actors: error: "), result.stderr
    return lines[0]


def test_data_dir_missing_folder(tmp_path: Path, store_dir: Path) -> None:
    missing = tmp_path / "json_2.1.1" / "train"
    line = actors_error(missing, store_dir)
    assert f"ALFWorld data_dir {missing} does not exist; accepted: a folder of ALFWorld" in line
    missing.mkdir(parents=True)  # there, but holding no task
    line = actors_error(missing, store_dir)
    assert f"no ALFWorld tasks under {missing}: no game.tw-pddl or traj_data.json" in line
    assert "alfworld-download" in line


def test_data_dir_task_without_game_file_names_alfworld_generate(
    tmp_path: Path, store_dir: Path
) -> None:
    trial = make_trial(tmp_path, game="", task_type="pick_and_place_simple")
    line = actors_error(tmp_path, store_dir)
    assert f"1 without game.tw-pddl, e.g. {trial}" in line
    assert f"`alfworld-generate --data_path {tmp_path}`" in line


def test_data_dir_raw_pddl_is_named(tmp_path: Path, store_dir: Path) -> None:
    trial = make_trial(tmp_path, game=PROBLEM)
    line = actors_error(tmp_path, store_dir)
    assert f"ALFWorld game file {trial / 'game.tw-pddl'} holds raw PDDL, not a game" in line
    (trial / "game.tw-pddl").write_text('{"pddl_problem": 3')  # broken JSON
    assert "is not JSON (Expecting" in actors_error(tmp_path, store_dir)
    (trial / "game.tw-pddl").write_text('{"pddl_problem": "(define)"}')
    assert "lacks pddl_domain, grammar" in actors_error(tmp_path, store_dir)


def test_data_dir_metric_before_goal_is_named(tmp_path: Path, store_dir: Path) -> None:
    problem = PROBLEM.replace(GOAL, f"(:metric minimize (totalCost))\n{GOAL}")
    trial = make_trial(tmp_path, game=game_json(pddl_problem=problem))
    line = actors_error(tmp_path, store_dir)
    assert f"the PDDL problem in {trial / 'game.tw-pddl'} has (:metric ...) before (:goal" in line


def test_data_dir_unsolvable_tasks_are_skipped_and_counted(
    tmp_path: Path, store_dir: Path, caplog
) -> None:
    unsolvable = make_trial(tmp_path, game=game_json(solvable=False, walkthrough=None))
    line = actors_error(tmp_path, store_dir)
    assert f"no playable ALFWorld tasks of task types {', '.join(TASK_TYPES)} under" in line
    assert (
        f"1 marked unsolvable (solvable: false in game.tw-pddl; ALFWorld skips these), e.g. {unsolvable}"
        in line
    )
    # Beside playable ones, they are left out and counted, as are ALFWorld's other skips.
    playable = make_trial(tmp_path, trial="trial_T2")
    make_trial(tmp_path, "pick_and_place_with_movable_recep-Apple-Pan-Shelf-1")
    make_trial(
        tmp_path,
        "pick_clean_then_place_in_recep-Apple-None-Sink-1",
        game="",
        task_type="pick_clean_then_place_in_recep",
    )
    found = scan(tmp_path, TASK_TYPES)
    assert found.games == [playable / "game.tw-pddl"]
    assert {k: len(v) for k, v in found.skipped.items()} == {
        "movable": 1,
        "no_game": 1,
        "unsolvable": 1,
    }
    with caplog.at_level("WARNING", logger="gagpo.actors"):
        assert find_games(tmp_path, TASK_TYPES) == found.games
    assert "playing 1 task(s) under" in caplog.text and "skipped 3: 1 with movable" in caplog.text


def test_data_dir_task_type_comes_from_traj_data(tmp_path: Path, store_dir: Path) -> None:
    # The folder name says pick_and_place_simple; traj_data.json, which wins, says look_at.
    look = make_trial(tmp_path, task_type="look_at_obj_in_light")
    assert scan(tmp_path, ["look_at_obj_in_light"]).games == [look / "game.tw-pddl"]
    line = actors_error(tmp_path, store_dir, "pick_and_place_simple")
    assert f"1 of other task types, e.g. {look}" in line
    # A folder not named after a task type, without traj_data.json: played when no task
    # type is asked for (its type does not matter then), named when one is.
    mine = make_trial(tmp_path / "other", "my-task")
    assert scan(tmp_path / "other", TASK_TYPES).games == [mine / "game.tw-pddl"]
    line = actors_error(tmp_path / "other", store_dir, "pick_and_place_simple")
    assert (
        f"1 of unknown task type (no traj_data.json, no task_type in the game file, no folder named after a task type), e.g. {mine}"
        in line
    )
    # A trial folder, or its game file, is a data_dir of one task.
    assert scan(mine, ["look_at_obj_in_light"]).skipped == {"unknown_type": [mine]}
    assert scan(look / "game.tw-pddl", ["look_at_obj_in_light"]).games == [look / "game.tw-pddl"]


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
        task = next(
            ln for ln in first.observation.splitlines() if ln.startswith("Your task is to:")
        )
        for i, command in enumerate(plan):
            tr = env.step(command)
            assert tr.action_valid and tr.state_key == key
            assert tr.observation.endswith(task) != tr.done  # restated until the task is done
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
    # ALFWorld's layout: <split>/<task>-<obj>-...-<scene>/<trial>/{game.tw-pddl, traj_data.json},
    # the game without a stored plan (the planner makes it), one trial ALFWorld would skip.
    source = ALFWorld(task_types=["pick_heat_then_place_in_recep"])
    source.reset(2)
    game = json.loads(source.game_path(2).read_text())
    del game["walkthrough"], game["task_type"]
    root = tmp_path / "json_2.1.1" / "train"
    trial = make_trial(
        root,
        "pick_heat_then_place_in_recep-Cup-None-CounterTop-7",
        game=json.dumps(game),
        task_type="pick_heat_then_place_in_recep",
    )
    skipped = root / "pick_and_place_with_movable_recep-Cup-Pan-Shelf-7" / "trial_T2019_2"
    shutil.copytree(trial, skipped)
    assert find_games(root, TASK_TYPES) == [trial / "game.tw-pddl"]

    for data_dir in (root, trial, trial / "game.tw-pddl"):  # a split, one trial, one file
        env = ALFWorld(data_dir=data_dir)
        first = env.reset(123)  # any seed picks one of the folder's games
        assert first.state_key == source.reset(2).state_key
        plan = env.expert_plan()
        assert plan == source.expert_plan()
        for command in plan:
            tr = env.step(command)
        assert tr.done and tr.won and tr.reward == 1.0
    with pytest.raises(GagpoError, match=r"no playable ALFWorld tasks of task types look_at"):
        ALFWorld(data_dir=root, task_types=["look_at_obj_in_light"])

    # A game no plan solves, not marked so: the engine's bare error becomes one naming it.
    goal = re.search(r"\(:goal.*", game["pddl_problem"], re.S)[0]
    unsolvable = {
        **game,
        "pddl_problem": game["pddl_problem"].replace(
            goal, "(:goal (and (isHot CounterTop_bar_1)))\n)"
        ),
    }
    (trial / "game.tw-pddl").write_text(json.dumps(unsolvable))
    with pytest.raises(GagpoError, match=rf"ALFWorld's engine cannot play {re.escape(str(trial))}"):
        ALFWorld(data_dir=trial).reset(0)
