"""TextWorld games: made offline by TextWorld's own generator from a seed and settings,
or a user's own game files (`game_files`, e.g. made with `tw-make`).

A generated game is the challenge (coin collector, treasure hunter, cooking, simple,
or a custom quest), its difficulty settings and the task seed. It is generated and
compiled to a Z-machine file once, in a child process whose HOME and TMPDIR point into
the cache (TextWorld's Inform 7 compiler writes into both), and kept under
`$GAGPO_CACHE/textworld/<challenge>-s<seed>-<hash>/` by an atomic rename, so concurrent
actors building the same game never see a half-written one. A user's game is a `.z8`
file with the `.json` that TextWorld writes beside it (its world, quests and
walkthrough, which the state tracking needs); task seed `s` plays the `s % n`-th of the
n files given. Games are played through TextWorld's Inform 7 interpreter with its state
tracking, generated and users' alike.

Rewards are the game's own points (the score's change), so intermediate rewards come
as the game gives them; the episode ends when the game is won or lost. The state key
is the game state TextWorld tracks: its facts whose predicates some rule of the
game's logic can change (rooms' layout and objects' kinds never change, so they are
left out), sorted, plus the score, which records quest progress that the facts don't.
A game that ends lost (e.g. the wrong object taken in a treasure hunt) is `done` and
not `won`. Replies are matched to the admissible commands whatever their case, and the
command is sent in the game's own spelling ("take type X latchkey"). A reply that names
no admissible command is not sent to the game (TextWorld's state tracking would lose
step with the interpreter): it changes nothing and costs `INVALID_ACTION_PENALTY`.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gagpo.envs.base import INVALID_ACTION_PENALTY, Reset, Transition
from gagpo.envs.external import (
    PIP_TEXTWORLD,
    clean_feedback,
    end_turn,
    match_command,
    require,
    write_json_atomic,
)
from gagpo.schemas.cache import cache_root
from gagpo.schemas.errors import GagpoError
from gagpo.storage.files import build_once

GAME_FORMAT = 1  # bump when the files a game folder holds change
# Challenge -> its settings and their defaults: small games a policy can finish in 30 turns.
# `recipe_seed=None` draws the cooking recipe from the task seed.
CHALLENGES: dict[str, dict[str, Any]] = {
    "tw-coin_collector": {"level": 5},
    "tw-treasure_hunter": {"level": 5},
    "tw-cooking": {
        "recipe": 1,
        "take": 1,
        "go": 1,
        "open": True,
        "cook": True,
        "cut": True,
        "drop": False,
        "recipe_seed": None,
        "split": "train",
    },
    "tw-simple": {"rewards": "dense", "goal": "detailed", "test": False},
    "custom": {
        "world_size": 3,
        "nb_objects": 6,
        "quest_length": 3,
        "quest_breadth": 1,
        "theme": "house",
    },
}
LEVELS = {"tw-coin_collector": (1, 300), "tw-treasure_hunter": (1, 30)}
GENERATE_TIMEOUT_S = 600
# The game files TextWorld 1.7 plays with its state tracking: Z-machine, with a .json beside.
GAME_EXTENSION = ".z8"
_USER_META: dict[tuple[str, int], dict[str, Any]] = {}  # (game file, mtime) -> its meta
_PLANS: dict[tuple[str, int], tuple[tuple[str, ...], tuple[str, ...]]] = {}  # checked walkthroughs
_MAKE_GAME = (
    "import sys; from gagpo.envs.textworld_env import make_game; "
    "make_game(sys.argv[1], sys.argv[2])"
)
NOTHING_HAPPENS = "Nothing happens."
END_MARK = "*** The End ***"
# Words of TextWorld's command grammar and of the challenges' fixed objects: the tiny
# policy's vocabulary. Names drawn from the text grammars vary per game and are not here.
VERBS = (
    "go",
    "north",
    "south",
    "east",
    "west",
    "look",
    "inventory",
    "examine",
    "take",
    "from",
    "drop",
    "put",
    "on",
    "insert",
    "into",
    "open",
    "close",
    "lock",
    "unlock",
    "with",
    "eat",
    "drink",
    "cook",
    "slice",
    "chop",
    "dice",
    "prepare",
    "meal",
)
NOUNS = (
    "coin",
    "cookbook",
    "knife",
    "stove",
    "oven",
    "bbq",
    "fridge",
    "counter",
    "table",
    "door",
    "key",
    "chest",
    "box",
)


def game_settings(challenge: str, level: int | None, settings: Mapping[str, Any] | None) -> dict:
    """The full settings of `challenge`: defaults, then `settings`, then `level`."""
    if challenge not in CHALLENGES:
        raise GagpoError(
            f"unknown TextWorld challenge {challenge!r}; accepted: {', '.join(CHALLENGES)}"
        )
    defaults = CHALLENGES[challenge]
    merged = dict(defaults)
    for key, value in (settings or {}).items():
        if key not in defaults:
            raise GagpoError(
                f"unknown setting {key!r} for {challenge}; accepted: {', '.join(defaults)}"
            )
        merged[key] = value
    if level is not None:
        if challenge not in LEVELS:
            raise GagpoError(f"level applies to {' and '.join(LEVELS)} only, not {challenge}")
        merged["level"] = level
    if challenge in LEVELS:
        low, high = LEVELS[challenge]
        if not isinstance(merged["level"], int) or not low <= merged["level"] <= high:
            raise GagpoError(
                f"{challenge} level must be an integer in [{low}, {high}], got {merged['level']!r}"
            )
    return merged


def game_spec(challenge: str, settings: Mapping[str, Any], seed: int, version: str) -> dict:
    """Everything that determines a generated game (what its cache key hashes)."""
    if challenge == "tw-cooking" and settings.get("recipe_seed") is None:
        settings = {**settings, "recipe_seed": seed}
    return {
        "format": GAME_FORMAT,
        "textworld": version,
        "challenge": challenge,
        "settings": dict(settings),
        "seed": seed,
    }


def game_dir(root: Path, spec: Mapping[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
    return root / f"{spec['challenge']}-s{spec['seed']}-{digest}"


def ensure_game(root: Path, spec: Mapping[str, Any]) -> Path:
    """The folder of the game `spec` under `root`, generating it first if needed."""

    def generate(out: Path) -> None:
        with tempfile.TemporaryDirectory(prefix=".scratch-", dir=root) as scratch:
            env = {"HOME": Path(scratch, "home"), "TMPDIR": Path(scratch, "tmp")}
            for path in env.values():
                path.mkdir()
            done = subprocess.run(
                [sys.executable, "-c", _MAKE_GAME, json.dumps(spec), str(out)],
                env={**os.environ, **{k: str(v) for k, v in env.items()}},
                capture_output=True,
                text=True,
                timeout=GENERATE_TIMEOUT_S,
            )
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
            raise GagpoError(
                f"TextWorld could not generate {spec['challenge']} with settings "
                f"{spec['settings']} and seed {spec['seed']}: {' | '.join(tail)}"
            )

    return build_once(game_dir(root, spec), generate)  # concurrent builders: one wins


def game_meta(game: Any) -> dict[str, Any]:
    """What the environment keeps of a `textworld.Game`: its walkthrough, its points in
    all, and the predicates that some rule of its logic adds or removes."""
    dynamic: set[str] = set()
    for rule in game.kb.logic.rules.values():
        dynamic |= {p.name for p in set(rule.preconditions) ^ set(rule.postconditions)}
    return {
        "walkthrough": list(game.metadata.get("walkthrough") or game.walkthrough or []),
        "max_score": game.max_score,
        "dynamic_predicates": sorted(dynamic),
    }


def make_game(spec_json: str, out_dir: str) -> None:
    """Generate and compile one game into `out_dir` (run in a child process by ensure_game)."""
    import textworld
    import textworld.challenges
    from textworld.generator import compile_game

    spec = json.loads(spec_json)
    settings = spec["settings"]
    options = textworld.GameOptions()
    options.seeds = spec["seed"]
    options.path = str(Path(out_dir) / "game.z8")
    options.file_ext = ".z8"
    options.force_recompile = True
    if spec["challenge"] == "custom":
        options.nb_rooms = settings["world_size"]
        options.nb_objects = settings["nb_objects"]
        options.chaining.min_length = options.chaining.max_length = settings["quest_length"]
        options.chaining.max_depth = settings["quest_length"]
        options.chaining.min_breadth = options.chaining.max_breadth = settings["quest_breadth"]
        options.grammar.theme = settings["theme"]
        _, game = textworld.make(options)
    else:
        _, make, _ = textworld.challenges.CHALLENGES[spec["challenge"]]
        game = make(settings=settings, options=options)
        compile_game(game, options)
    write_json_atomic(Path(out_dir) / "meta.json", {"spec": spec, **game_meta(game)})


def user_games(game_files: str | os.PathLike | Sequence[str | os.PathLike]) -> tuple[Path, ...]:
    """The game files `game_files` names: a file, a glob, or a list of either; a glob's
    matches sorted, the list's order kept. Each is a `.z8` with its `.json` beside it."""
    entries = [game_files] if isinstance(game_files, str | os.PathLike) else list(game_files)
    if not entries:
        raise GagpoError(
            "game_files is empty; accepted: a .z8 game file, a glob, or a list of them"
        )
    games: list[Path] = []
    for entry in entries:
        text = os.path.expanduser(os.fspath(entry))
        if any(c in text for c in "*?["):
            found = sorted(Path(p) for p in glob.glob(text, recursive=True) if Path(p).is_file())
            # tw-make's folder also holds the .json and .ni; .ulx stays, to be named below.
            found = [p for p in found if p.suffix in (GAME_EXTENSION, ".ulx")]
            if not found:
                raise GagpoError(f"no TextWorld game files match {text!r}; accepted: .z8 files")
        else:
            found = [Path(text)]
        for path in found:
            games.append(_checked_game_file(path))
    return tuple(dict.fromkeys(games))


def _checked_game_file(path: Path) -> Path:
    if path.suffix == ".ulx":
        raise GagpoError(
            f"TextWorld game file {path} is Glulx (.ulx), which TextWorld 1.7 no longer plays; "
            f"accepted: .z8 (make the game again with tw-make, which writes .z8)"
        )
    if path.suffix != GAME_EXTENSION:
        raise GagpoError(
            f"{path} is not a TextWorld game file; accepted: a .z8 file with its .json beside it"
        )
    if not path.is_file():
        raise GagpoError(f"TextWorld game file {path} does not exist")
    if not path.with_suffix(".json").is_file():
        raise GagpoError(
            f"TextWorld game file {path} has no {path.with_suffix('.json').name} beside it; "
            f"tw-make writes both, and the environment needs the .json (world, quests, "
            f"walkthrough) to track the game's state"
        )
    return path.resolve()


def user_game_meta(path: Path) -> dict[str, Any]:
    """`game_meta` of a user's game file, read from its .json (once per file version)."""
    source = path.with_suffix(".json")
    key = (str(source), source.stat().st_mtime_ns)
    if key not in _USER_META:
        textworld = require("textworld", PIP_TEXTWORLD)
        try:
            game = textworld.Game.load(str(source))
        except Exception as exc:  # any failure to parse is the file's
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise GagpoError(
                f"cannot read TextWorld game {source} ({type(exc).__name__}: {reason}); "
                f"accepted: the .json tw-make wrote beside the .z8"
            ) from None
        _USER_META[key] = game_meta(game)
    return _USER_META[key]


@contextmanager
def _quiet_jericho() -> Iterator[None]:
    # Jericho warns that TextWorld's games are "not fully supported": it cannot read their
    # score itself, which TextWorld's own state tracking does instead.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Game .* is not fully supported")
        yield


def _fact_text(fact: Any) -> str:
    return f"{fact.name}({', '.join(v.name for v in fact.arguments)})"


def _observation(feedback: str) -> str:
    text = clean_feedback(feedback)
    end = text.find(END_MARK)
    return text if end < 0 else text[: end + len(END_MARK)]


class TextWorld:
    """A TextWorld game per task seed; reward = points scored, done when won or lost."""

    name = "textworld"
    # TextWorld's engine keeps process-global state (its parser, the game loader): two
    # threads resetting games at once fail, so slots step it one at a time (actors/slots.py).
    thread_safe = False
    revision = 1  # 1: the objective is restated in every observation (warm-start caches key on it)

    def __init__(
        self,
        max_turns: int = 30,
        *,
        challenge: str | None = None,
        level: int | None = None,
        settings: Mapping[str, Any] | None = None,
        game_files: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
        cache_dir: str | os.PathLike | None = None,
    ) -> None:
        """`challenge`: one of CHALLENGES, default tw-coin_collector; `level`: difficulty of
        coin collector (1-300) or treasure hunter (1-30); `settings`: other challenge
        settings (see CHALLENGES); `game_files`: play these games instead of generated ones
        (a .z8 file with its .json, a glob, or a list of them; task seed s plays the
        s % n-th); `cache_dir`: where generated games are kept, default
        `$GAGPO_CACHE/textworld`."""
        if max_turns < 1:
            raise GagpoError(f"max_turns must be at least 1, got {max_turns}")
        self.max_turns = max_turns
        self.games: tuple[Path, ...] | None = None
        if game_files is not None:
            given = [
                k
                for k, v in (("challenge", challenge), ("level", level), ("settings", settings))
                if v is not None
            ]
            if given:
                raise GagpoError(
                    f"{', '.join(given)} apply to generated games; with game_files the games "
                    f"are the files given (accepted: game_files alone, or no game_files)"
                )
            self.games = user_games(game_files)
        self.challenge = challenge or "tw-coin_collector"
        self.settings = game_settings(self.challenge, level, settings)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else cache_root() / "textworld"
        self._game: Path | None = None
        self._meta: dict[str, Any] = {}
        self._dynamic: frozenset[str] = frozenset()
        self._tw: Any = None
        self._state_key = ""
        self._admissible: tuple[str, ...] = ()
        self._score = 0
        self._task: str | None = None
        self._turn = 0
        self._over = True
        self.walkthrough_skipped: tuple[str, ...] = ()  # by the last expert_plan() (its doc)

    def game_path(self, task_seed: int) -> Path:
        """The game file task `task_seed` plays: a user's, or the generated one (made on
        first use)."""
        if self.games is not None:
            return self.games[task_seed % len(self.games)]
        textworld = require("textworld", PIP_TEXTWORLD)
        spec = game_spec(self.challenge, self.settings, task_seed, textworld.__version__)
        return ensure_game(self.cache_dir, spec) / "game.z8"

    def reset(self, task_seed: int) -> Reset:
        game = self.game_path(task_seed)
        if game != self._game:
            self._load(game)
        with _quiet_jericho():
            state = self._tw.reset()
        self._score = state["score"] or 0
        self._turn = 0
        self._over = False
        self._observe(state)
        objective = " ".join(state["objective"].split())
        self._task = objective or None  # restated after every later observation (end_turn)
        observation = f"{objective}\n\n{clean_feedback(state['description'])}"
        return Reset(observation, self._state_key, self._admissible)

    def _load(self, game: Path) -> None:
        textworld = require("textworld", PIP_TEXTWORLD)
        if self.games is None:
            meta = json.loads((game.parent / "meta.json").read_text())
        else:
            meta = user_game_meta(game)
        self.close()
        infos = textworld.EnvInfos(
            description=True,
            objective=True,
            facts=True,
            score=True,
            won=True,
            lost=True,
            admissible_commands=True,
        )
        with _quiet_jericho():
            self._tw = textworld.start(str(game), request_infos=infos)
        self._meta = meta
        self._dynamic = frozenset(meta["dynamic_predicates"])
        self._game = game

    def _observe(self, state: Any) -> None:
        facts = sorted(_fact_text(f) for f in state["facts"] if f.name in self._dynamic)
        self._state_key = "\n".join([f"score: {self._score}", *facts])
        self._admissible = tuple(state["admissible_commands"])

    def step(self, reply: str) -> Transition:
        if self._over or self._tw is None:
            raise RuntimeError("the TextWorld episode is over (or never began); call reset() first")
        before = self._state_key
        command = match_command(reply, self._admissible)  # in the game's own spelling
        self._turn += 1
        done = won = False
        if command is None:
            observation, reward, valid = NOTHING_HAPPENS, INVALID_ACTION_PENALTY, False
        else:
            state, score, _ = self._tw.step(command)
            reward, self._score, valid = float(score - self._score), score, True
            won = bool(state["won"])
            done = won or bool(state["lost"])
            self._observe(state)
            observation = _observation(state.feedback) or NOTHING_HAPPENS
        return end_turn(
            self,
            observation=observation,
            before=before,
            reward=reward,
            done=done,
            valid=valid,
            won=won,
        )

    def close(self) -> None:
        """Release the interpreter of the loaded game (a new reset loads it again)."""
        if self._tw is not None:
            self._tw.close()
        self._tw, self._game = None, None

    @property
    def max_score(self) -> int | None:
        """The points the loaded game awards in all (None before the first reset)."""
        return self._meta.get("max_score") if self._game is not None else None

    @property
    def instructions(self) -> str:
        return (
            "You are playing a text adventure game. Each turn you read what happened and "
            "reply with one command, such as: go north, look, inventory, examine cookbook, "
            "take coin, take apple from fridge, put apple on table, open door, unlock door "
            "with key, cook carrot with stove, slice carrot with knife, eat meal. The game "
            "awards points for progress and ends when you complete its task. A command the "
            "game cannot carry out here changes nothing and costs 0.1. Reply with exactly "
            "one command."
        )

    def expert_plan(self) -> list[str] | None:
        """The game's walkthrough from its start, checked on the game itself: commands the
        game rejects where they come (not admissible there, e.g. a second "open fridge")
        are skipped, the rest are given in the game's own spelling; `walkthrough_skipped`
        holds what was skipped, and a walkthrough with any is one line on stderr."""
        if self._game is None:
            return None
        key = (str(self._game), self._game.stat().st_mtime_ns)
        if key not in _PLANS:
            _PLANS[key] = self._replay_walkthrough()
        plan, self.walkthrough_skipped = _PLANS[key]
        return list(plan)

    def _replay_walkthrough(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(plan, skipped): the walkthrough played on a second copy of the game, from its
        start, until the game ends (commands after that are skipped too)."""
        textworld = require("textworld", PIP_TEXTWORLD)
        infos = textworld.EnvInfos(admissible_commands=True, won=True, lost=True)
        plan: list[str] = []
        skipped: list[str] = []
        with _quiet_jericho():
            replay = textworld.start(str(self._game), request_infos=infos)
            try:
                state = replay.reset()
                for written in self._meta["walkthrough"]:
                    command = match_command(written, tuple(state["admissible_commands"]))
                    if command is None or state["won"] or state["lost"]:
                        skipped.append(written)
                        continue
                    state, _, _ = replay.step(command)
                    plan.append(command)
            finally:
                replay.close()
        if skipped:
            print(
                f"textworld: the walkthrough of {self._game} has {len(skipped)} command(s) the "
                f"game rejects where they come, skipped in the expert plan: {', '.join(skipped)}",
                file=sys.stderr,
                flush=True,
            )
        return tuple(plan), tuple(skipped)

    @classmethod
    def vocabulary(cls) -> list[str]:
        return sorted({*VERBS, *NOUNS})
