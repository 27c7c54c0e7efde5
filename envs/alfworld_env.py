"""ALFWorld's text engine, on PDDL problems the project generates or on ALFWorld's game files.

Games are played by ALFWorld's own engine: TextWorld's PDDL environment (Fast Downward
keeps the state and lists the applicable actions) with ALFWorld's domain, its text
grammar, and its demangler that names entities "apple 1", "sinkbasin 1". Without
`data_dir`, a task seed gives a generated task (pddl_gen.py) of one of the six task
types, cached as an ALFWorld game file under `$GAGPO_CACHE/alfworld/`; with `data_dir`,
it picks one of ALFWorld's own game files (`game.tw-pddl`) under that folder
(alfworld_data.py finds them, reads their task types and names what cannot be played).

The expert plan is Fast Downward's plan from the start, as ALFWorld's planner expert
gives it (stored in the game file when the project generates it). Reward is 1 on
success, as in the paper's setup, and success is the only way an episode ends, so a
done episode is won. The state key is the engine's PDDL state: every true
fact except those that never change (types, locations of receptacles, what can hold
what) and the bookkeeping ones no action depends on (which receptacles were looked at).
Replies that name no admissible command are not sent to the engine; they change
nothing and cost `INVALID_ACTION_PENALTY`. The "help" command is left out of the
admissible list: it only prints the command list, which the instructions already give.

Each engine loads its own copy of Fast Downward's 30 MB library, so engines are kept in
a small pool and handed from one environment instance to the next.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gagpo.envs.alfworld_data import GAME_FILE, find_games
from gagpo.envs.base import INVALID_ACTION_PENALTY, Reset, Transition
from gagpo.envs.external import (
    PIP_ALFWORLD,
    end_turn,
    match_command,
    require,
    write_json_atomic,
)
from gagpo.envs.parse import normalise_command
from gagpo.envs.pddl_gen import TASK_TYPES, Knowledge, generate_task, vocabulary_types
from gagpo.schemas.cache import cache_root
from gagpo.schemas.errors import GagpoError

GAME_FORMAT = 1  # bump when generated game files change
NOTHING_HAPPENS = "Nothing happens."
# Facts left out of the state key: static ones and ALFWorld's look/examine bookkeeping.
STATIC_PREDICATES = frozenset(
    {
        "receptacletype",
        "objecttype",
        "cancontain",
        "openable",
        "pickupable",
        "moveable",
        "cleanable",
        "heatable",
        "coolable",
        "toggleable",
        "sliceable",
        "isreceptacleobject",
        "receptacleatlocation",
        "checked",
        "examined",
        "holdsany",
        "holdsanyreceptacleobject",
        "objectatlocation",
    }
)
HIDDEN_COMMANDS = frozenset({"help"})
TASK_PREFIX = "Your task is to:"  # the line of the first observation restated every turn
VERBS = (
    "go",
    "to",
    "open",
    "close",
    "take",
    "from",
    "move",
    "put",
    "in",
    "on",
    "heat",
    "cool",
    "clean",
    "with",
    "use",
    "examine",
    "inventory",
    "look",
    "slice",
)
_PUT = re.compile(r"^(?:put|place) (.+?) (?:in/on|in|on|into|onto|to) (.+)$")
_MAX_IDLE_ENGINES = 16
_IDLE: list[_Engine] = []
_PLANS: dict[str, list[str]] = {}  # game key -> plan from the start, once computed


@functools.lru_cache(maxsize=8)
def _game_logic(domain: str, grammar: str) -> Any:
    """A game's parsed domain and grammar; the G engines of a group load the same one."""
    from textworld.envs.pddl import logic

    return logic.GameLogic(domain=domain, grammar=grammar)


@functools.cache
def _pddl_env_class() -> type:
    """TextWorld's PddlEnv, loading games with a shared parsed logic (see `_game_logic`)."""
    from textworld.envs.pddl import PddlEnv, logic

    class SharedLogicPddlEnv(PddlEnv):
        def load(self, data: dict[str, Any]) -> None:  # PddlEnv.load, the logic parsed once
            self._game_file = None
            self._game_data = data
            self.walkthrough = data.get("walkthrough")
            self._logic = _game_logic(data["pddl_domain"], data["grammar"])
            self._pddl_state = logic.PddlState(self.downward_lib, data["pddl_problem"], self._logic)
            self._entity_infos = self._get_entity_infos()

    return SharedLogicPddlEnv


class _Engine:
    """One ALFWorld text engine and the game it holds."""

    def __init__(self) -> None:
        textworld = require("textworld", PIP_ALFWORLD)
        require("textworld.envs.pddl.logic", PIP_ALFWORLD)  # fast_downward is needed there
        _alfworld_import_setup()
        tw_env = require("alfworld.agents.environment.alfred_tw_env", PIP_ALFWORLD)
        infos = textworld.EnvInfos(
            facts=True, admissible_commands=True, won=True, extras=["walkthrough"]
        )
        self.pddl = _pddl_env_class()(infos)
        self.env = tw_env.AlfredDemangler(self.pddl, shuffle=False)
        self.key: str | None = None

    def load(self, key: str, data: dict[str, Any]) -> None:
        if key != self.key:
            self.key = None
            self.env.load({**data, "walkthrough": data.get("walkthrough") or _PLANS.get(key)})
            self.key = key

    def reset(self) -> Any:
        state = self.env.reset()
        if self.pddl.walkthrough is None:  # planned by this reset: keep it for the next ones
            self.pddl.walkthrough = _PLANS[self.key] = list(state["extra.walkthrough"])
        return state

    def close(self) -> None:
        import fast_downward

        fast_downward.close_lib(self.pddl.downward_lib)


def _acquire(key: str) -> _Engine:
    for i, engine in enumerate(_IDLE):
        if engine.key == key:
            return _IDLE.pop(i)
    return _IDLE.pop() if _IDLE else _Engine()


def _release(engine: _Engine) -> None:
    if len(_IDLE) < _MAX_IDLE_ENGINES:
        _IDLE.append(engine)
    else:
        engine.close()


def _alfworld_import_setup() -> None:
    # alfworld creates $ALFWORLD_DATA (default ~/.cache/alfworld) when imported: keep it in our cache.
    os.environ.setdefault("ALFWORLD_DATA", str(cache_root() / "alfworld" / "data"))


def _logic_files() -> tuple[str, str]:
    """ALFWorld's PDDL domain and text grammar, as its package ships them."""
    from importlib import resources

    _alfworld_import_setup()
    require("alfworld", PIP_ALFWORLD)
    data = resources.files("alfworld") / "data"
    return (data / "alfred.pddl").read_text(), (data / "alfred.twl2").read_text()


def generated_game(cache_dir: Path, task_type: str, seed: int) -> Path:
    """The game file of generated task (`task_type`, `seed`), made and planned on first use."""
    from importlib import metadata

    _alfworld_import_setup()
    require("alfworld", PIP_ALFWORLD)
    spec = {
        "format": GAME_FORMAT,
        "alfworld": metadata.version("alfworld"),
        "task_type": task_type,
        "seed": seed,
    }
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
    path = cache_dir / f"{task_type}-s{seed}-{digest}.{GAME_FILE.split('.', 1)[1]}"
    if path.is_file():
        return path
    task = generate_task(seed, task_type, Knowledge.from_alfworld())
    domain, grammar = _logic_files()
    data = {
        "pddl_domain": domain,
        "grammar": grammar.replace("UNKNOWN GOAL", task.description),
        "pddl_problem": task.problem,
        "task_type": task_type,
        "scene": task.scene,
        "spec": spec,
    }
    engine = _acquire("")
    try:
        engine.load(str(path), data)
        plan = list(engine.reset()["extra.walkthrough"])
    finally:
        _release(engine)
    if not plan:
        raise RuntimeError(f"the planner found no plan for generated {task_type} task {seed}")
    write_json_atomic(path, {**data, "solvable": True, "walkthrough": plan})
    return path


def _in_key(predicate: str) -> bool:
    # The engine also records "not_<p>" for each fact an action made false: a trace of the
    # path taken, not of the state (PDDL states are closed-world), so it stays out.
    return predicate not in STATIC_PREDICATES and not predicate.startswith("not_")


def _fact_text(fact: Any) -> str:
    return f"{fact.name}({', '.join(v.name.strip() for v in fact.arguments)})"


def _canonical(reply: str) -> str:
    """The reply's command with the older "put X in/on Y" spelling mapped to "move X to Y"."""
    command = normalise_command(reply)
    if match := _PUT.match(command):
        return f"move {match[1]} to {match[2]}"
    return command


class ALFWorld:
    """ALFWorld text tasks; reward 1 and done on success."""

    name = "alfworld"
    # TextWorld's engine keeps process-global state (its parser, the game loader): two
    # threads resetting games at once fail, so slots step it one at a time (actors/slots.py).
    thread_safe = False
    revision = 1  # 1: the task is restated in every observation (warm-start caches key on it)

    def __init__(
        self,
        max_turns: int = 30,
        *,
        task_types: Sequence[str] = TASK_TYPES,
        data_dir: str | os.PathLike | None = None,
        cache_dir: str | os.PathLike | None = None,
    ) -> None:
        """`task_types`: the kinds of task to play (task seed `s` plays kind
        `task_types[s % len(task_types)]` when generating); `data_dir`: ALFWorld's game
        files to play instead (a split folder such as `$ALFWORLD_DATA/json_2.1.1/train`,
        any folder below it down to one trial, or a game.tw-pddl file; seed s plays the
        s % n-th game of those types), None to play generated tasks; `cache_dir`: where
        generated games are kept, default `$GAGPO_CACHE/alfworld`."""
        if max_turns < 1:
            raise GagpoError(f"max_turns must be at least 1, got {max_turns}")
        unknown = [t for t in task_types if t not in TASK_TYPES]
        if unknown or not task_types:
            raise GagpoError(
                f"unknown ALFWorld task types {unknown}; accepted: {', '.join(TASK_TYPES)}"
            )
        self.max_turns = max_turns
        self.task_types = tuple(task_types)
        self.data_dir = Path(data_dir).expanduser() if data_dir is not None else None
        if self.data_dir is not None:  # scanned once per process; errors before any rollout
            find_games(self.data_dir, self.task_types)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else cache_root() / "alfworld"
        self._engine: _Engine | None = None
        self._finalizer: weakref.finalize | None = None
        self._game: Path | None = None
        self._state_key = ""
        self._admissible: tuple[str, ...] = ()
        self._task: str | None = None
        self._turn = 0
        self._over = True

    def game_path(self, task_seed: int) -> Path:
        """The game file task `task_seed` plays."""
        if self.data_dir is None:
            task_type = self.task_types[task_seed % len(self.task_types)]
            return generated_game(self.cache_dir / "generated", task_type, task_seed)
        games = find_games(self.data_dir, self.task_types)
        return games[task_seed % len(games)]

    def reset(self, task_seed: int) -> Reset:
        game = self.game_path(task_seed)
        if self._engine is None:
            self._engine = _acquire(self._key(game))
            self._finalizer = weakref.finalize(self, _release, self._engine)
        if self.data_dir is None:
            self._engine.load(self._key(game), json.loads(game.read_text()))
            state = self._engine.reset()
        else:
            state = self._start_user_game(game)
        self._game = game
        self._turn = 0
        self._over = False
        self._observe(state)
        lines = [
            ln for ln in state.feedback.strip().splitlines() if not ln.startswith("-= Welcome")
        ]
        self._task = next((ln.strip() for ln in lines if ln.startswith(TASK_PREFIX)), None)
        return Reset("\n".join(lines).strip(), self._state_key, self._admissible)

    def _key(self, game: Path) -> str:
        """What engines and plans are cached under: a generated game's name says all of
        its content; a user's file may be edited between runs."""
        return str(game) if self.data_dir is None else f"{game}@{game.stat().st_mtime_ns}"

    def _start_user_game(self, game: Path) -> Any:
        """Load and reset a game of `data_dir`; the engine's failures name the file."""
        assert self._engine is not None
        try:
            self._engine.load(self._key(game), json.loads(game.read_text()))
            state = self._engine.reset()
        except Exception as exc:  # the engine's parser and planner raise bare errors
            self._engine.key = None  # half-loaded: load again next time
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else "no message"
            raise GagpoError(
                f"ALFWorld's engine cannot play {game} ({type(exc).__name__}: {reason}); its "
                f"PDDL problem is malformed or has no plan (alfworld-generate marks those "
                f"solvable: false, and they are skipped)"
            ) from None
        if not state["extra.walkthrough"]:
            raise GagpoError(f"the planner found no plan for {game}; it cannot be solved")
        return state

    def _observe(self, state: Any) -> None:
        facts = sorted(_fact_text(f) for f in state["facts"] if _in_key(f.name))
        self._state_key = "\n".join(facts)
        self._admissible = tuple(
            c for c in state["admissible_commands"] if c not in HIDDEN_COMMANDS
        )

    def step(self, reply: str) -> Transition:
        if self._over or self._engine is None:
            raise RuntimeError("the ALFWorld episode is over (or never began); call reset() first")
        before = self._state_key
        command = match_command(_canonical(reply), self._admissible)
        self._turn += 1
        done = False
        if command is None:
            observation, reward, valid = NOTHING_HAPPENS, INVALID_ACTION_PENALTY, False
        else:
            state, _, _ = self._engine.env.step(command)
            done, valid = bool(state["won"]), True
            reward = 1.0 if done else 0.0
            self._observe(state)
            observation = state.feedback.strip()
        return end_turn(
            self,
            observation=observation,
            before=before,
            reward=reward,
            done=done,
            valid=valid,
            won=done,  # the engine ends an episode only when its goal is met
        )

    def close(self) -> None:
        """Hand the engine back to the pool (a new reset takes one again)."""
        if self._finalizer is not None:
            self._finalizer()
        self._engine, self._finalizer = None, None

    @property
    def instructions(self) -> str:
        return (
            "You are in a household and must complete a task. Commands: go to R, open R, "
            "close R, take O from R, move O to R, clean O with R, heat O with R, cool O with R, "
            "use O, examine O, examine R, inventory, look (R is a receptacle such as "
            "cabinet 2, O an object such as mug 1). Clean in a sink basin, heat in a "
            "microwave, cool in a fridge, and use a desk lamp to look at something under it. "
            "You carry one object at a time; open a closed receptacle before taking from it "
            "or putting into it. Completing the task earns 1; a command that cannot be "
            "carried out changes nothing and costs 0.1. Reply with exactly one command."
        )

    def expert_plan(self) -> list[str] | None:
        """Fast Downward's plan from the start of the current game, as ALFWorld's planner
        expert gives it."""
        if self._game is None or self._engine is None:
            return None
        return list(_PLANS.get(self._key(self._game)) or self._engine.pddl.walkthrough or [])

    @classmethod
    def vocabulary(cls) -> list[str]:
        return sorted({*VERBS, *vocabulary_types()})
