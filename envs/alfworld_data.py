"""ALFWorld's own game files in a user's folder: find them, read their task types, say
what is wrong with the ones that cannot be played.

The official layout is `json_2.1.1/<split>/<task type>-<objects>-<scene>/<trial>/`
holding `traj_data.json` (the task, its type included) and `game.tw-pddl` (the game:
a JSON object with the PDDL domain, the text grammar and the PDDL problem, which
`alfworld-generate` writes from the trial's `initial_state.pddl`). `data_dir` may be
any folder of that tree, down to one trial folder, or a game file itself.

A trial is skipped, and counted, where ALFWorld itself skips it: movable receptacles
or sliced objects, another task type, no game file yet, or marked unsolvable. A game
file that cannot be read is an error that names it: playing around a broken file
would hide it. Nothing here imports ALFWorld: scanning works without the engine.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gagpo.envs.pddl_gen import TASK_TYPES
from gagpo.schemas.errors import GagpoError

GAME_FILE = "game.tw-pddl"
TRAJ_FILE = "traj_data.json"
PROBLEM_FILE = "initial_state.pddl"  # what alfworld-generate makes GAME_FILE from
GAME_KEYS = ("pddl_domain", "grammar", "pddl_problem")
LAYOUT = (
    "a folder of ALFWorld tasks (<split>/<task type>-<objects>-<scene>/<trial>/game.tw-pddl "
    "with traj_data.json, e.g. $ALFWORLD_DATA/json_2.1.1/train), one trial folder, or a "
    "game.tw-pddl file"
)
log = logging.getLogger("gagpo.actors")

# Why a trial is left out -> how the count reads in messages.
SKIP_REASONS = {
    "movable": "with movable receptacles or sliced objects (ALFWorld leaves these out)",
    "task_type": "of other task types",
    "unknown_type": "of unknown task type (no traj_data.json, no task_type in the game "
    "file, no folder named after a task type)",
    "no_game": "without game.tw-pddl",
    "unsolvable": "marked unsolvable (solvable: false in game.tw-pddl; ALFWorld skips these)",
}


@dataclass
class GameSet:
    """The playable game files under a folder, in a fixed order, and what was left out."""

    games: list[Path] = field(default_factory=list)
    skipped: dict[str, list[Path]] = field(default_factory=dict)

    def skip(self, reason: str, trial: Path) -> None:
        self.skipped.setdefault(reason, []).append(trial)

    def skipped_text(self, data_dir: Path) -> str:
        parts = []
        for reason in (r for r in SKIP_REASONS if r in self.skipped):  # a fixed order
            trials = self.skipped[reason]
            text = f"{len(trials)} {SKIP_REASONS[reason]}, e.g. {trials[0]}"
            if reason == "no_game":
                text += (
                    f"; make the game files with `alfworld-generate --data_path {data_dir}`, "
                    f"which writes {GAME_FILE} beside each {TRAJ_FILE}"
                )
            parts.append(text)
        return "; ".join(parts)


_SCANNED: dict[tuple[str, tuple[str, ...]], GameSet] = {}


def find_games(data_dir: Path, task_types: Sequence[str]) -> list[Path]:
    """The game files under `data_dir` of `task_types`, in a fixed order (scanned once per
    process); a GagpoError naming the cause when there are none or one is unreadable."""
    key = (str(data_dir), tuple(task_types))
    if key not in _SCANNED:
        found = scan(data_dir, task_types)
        if not found.games:
            raise GagpoError(
                f"no playable ALFWorld tasks of task types {', '.join(task_types)} under "
                f"{data_dir}: {found.skipped_text(data_dir) or 'it holds no tasks'}"
            )
        if found.skipped:
            log.warning(
                "alfworld: playing %d task(s) under %s; skipped %d: %s",
                len(found.games),
                data_dir,
                sum(map(len, found.skipped.values())),
                found.skipped_text(data_dir),
            )
        _SCANNED[key] = found
    return _SCANNED[key].games


def scan(data_dir: Path, task_types: Sequence[str]) -> GameSet:
    """Every trial under `data_dir`, played or skipped with its reason."""
    if not data_dir.exists():
        raise GagpoError(f"ALFWorld data_dir {data_dir} does not exist; accepted: {LAYOUT}")
    if data_dir.is_file():
        if data_dir.name != GAME_FILE and data_dir.suffix != ".tw-pddl":
            raise GagpoError(f"ALFWorld data_dir {data_dir} is a file; accepted: {LAYOUT}")
        trials = [data_dir.parent]
    else:
        marks = (GAME_FILE, TRAJ_FILE, PROBLEM_FILE)
        trials = sorted({p.parent for mark in marks for p in data_dir.rglob(mark)})
        if not trials:
            raise GagpoError(
                f"no ALFWorld tasks under {data_dir}: no {GAME_FILE} or {TRAJ_FILE} in it or "
                f"below; accepted: {LAYOUT}. Fetch them with `alfworld-download` on a machine "
                f"with internet access, or leave data_dir unset to play generated tasks"
            )
    filtering = set(task_types) != set(TASK_TYPES)
    found = GameSet()
    for trial in trials:
        game_file = data_dir if data_dir.is_file() else trial / GAME_FILE
        rel = trial.as_posix()
        if "movable" in rel or "Sliced" in rel:
            found.skip("movable", trial)
            continue
        if not game_file.is_file():
            found.skip("no_game", trial)
            continue
        data = read_game(game_file)
        task_type = trial_task_type(trial, data)
        if task_type is None and filtering:
            found.skip("unknown_type", trial)
        elif task_type is not None and task_type not in task_types:
            found.skip("task_type", trial)
        elif data.get("solvable") is False:
            found.skip("unsolvable", trial)
        else:
            found.games.append(game_file)
    return found


def read_game(path: Path) -> dict:
    """A game file's JSON, checked for what ALFWorld's engine needs before it loads it."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise GagpoError(f"cannot read ALFWorld game file {path} ({exc})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        if text.lstrip().startswith("(define"):
            raise GagpoError(
                f"ALFWorld game file {path} holds raw PDDL, not a game; accepted: the JSON "
                f"that `alfworld-generate` writes ({', '.join(GAME_KEYS)}), made from a "
                f"trial's {PROBLEM_FILE} and {TRAJ_FILE}"
            ) from None
        raise GagpoError(
            f"ALFWorld game file {path} is not JSON ({exc}); accepted: the JSON that "
            f"`alfworld-generate` writes ({', '.join(GAME_KEYS)})"
        ) from None
    missing = [
        k for k in GAME_KEYS if not isinstance(data, dict) or not isinstance(data.get(k), str)
    ]
    if missing:
        raise GagpoError(
            f"ALFWorld game file {path} lacks {', '.join(missing)}; accepted: the JSON that "
            f"`alfworld-generate` writes ({', '.join(GAME_KEYS)})"
        )
    problem = data["pddl_problem"]
    metric, goal = problem.find("(:metric"), problem.find("(:goal")
    if goal < 0:
        raise GagpoError(f"the PDDL problem in {path} has no (:goal ...) section")
    if 0 <= metric < goal:
        raise GagpoError(
            f"the PDDL problem in {path} has (:metric ...) before (:goal ...); accepted: "
            f"(:goal ...) first, then (:metric ...), the order Fast Downward parses"
        )
    return data


def trial_task_type(trial: Path, data: dict) -> str | None:
    """The trial's task type: from its traj_data.json, else the game file's own
    `task_type` (the project's generated games), else a folder named after one."""
    traj = trial / TRAJ_FILE
    if traj.is_file():
        try:
            task_type = json.loads(traj.read_text()).get("task_type")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as exc:
            raise GagpoError(
                f"cannot read the task type from {traj} ({type(exc).__name__}: {exc}); "
                f"accepted: ALFWorld's traj_data.json, a JSON object with task_type"
            ) from None
        if task_type is not None:
            return str(task_type)
    if isinstance(data.get("task_type"), str):
        return data["task_type"]
    for part in (trial.name, trial.parent.name):
        for task_type in TASK_TYPES:
            if part.startswith(task_type):
                return task_type
    return None
