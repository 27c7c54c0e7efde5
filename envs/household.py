"""An ALFWorld-like household text world, generated from a seed.

One room holds receptacles (cabinets, drawers, a fridge, a microwave, a sink basin, a
desk lamp on a desk or side table, ...) with objects in them; some receptacles are
closed. The task is one of ALFWorld's six kinds: pick and place, clean, heat, cool,
look at an object under the desk lamp, and pick two. Commands and the list of
admissible commands follow ALFWorld's text interface. The admissible list is the one
definition of validity: a command is valid exactly when it is in that list, and
`_apply` only has to say what a valid command does.

The state key is the canonical text of the world (where the agent is, what it holds,
each receptacle's open state and contents, object properties, the lamp), never the
dialogue, so rollouts meeting the same world state share a key.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from gagpo.envs.base import INVALID_ACTION_PENALTY, Reset, Transition
from gagpo.envs.parse import normalise_command
from gagpo.schemas.errors import GagpoError

GOAL_KINDS = ("pick_place", "clean", "heat", "cool", "look_in_light", "pick_two")
RECEPTACLE_TYPES = (
    "cabinet",
    "countertop",
    "desk",
    "diningtable",
    "drawer",
    "fridge",
    "garbagecan",
    "microwave",
    "shelf",
    "sidetable",
    "sinkbasin",
)
OPENABLE = frozenset({"cabinet", "drawer", "fridge", "microwave"})
# Receptacles a goal may ask to put something in or on.
STORAGE = ("cabinet", "countertop", "desk", "diningtable", "drawer", "shelf", "sidetable")
_INSIDE = frozenset({"cabinet", "drawer", "fridge", "garbagecan", "microwave", "sinkbasin"})
# Object type -> receptacle types it may start in.
OBJECT_HOMES: dict[str, tuple[str, ...]] = {
    "apple": ("countertop", "diningtable", "fridge", "garbagecan"),
    "bread": ("countertop", "diningtable", "fridge", "cabinet"),
    "egg": ("countertop", "fridge", "diningtable"),
    "lettuce": ("countertop", "fridge", "diningtable"),
    "potato": ("countertop", "fridge", "garbagecan", "diningtable"),
    "tomato": ("countertop", "fridge", "diningtable"),
    "mug": ("cabinet", "countertop", "shelf", "sinkbasin", "diningtable"),
    "cup": ("cabinet", "countertop", "shelf", "fridge"),
    "bowl": ("cabinet", "countertop", "shelf", "diningtable"),
    "plate": ("cabinet", "countertop", "diningtable", "shelf"),
    "pan": ("cabinet", "countertop"),
    "knife": ("drawer", "countertop", "diningtable"),
    "spoon": ("drawer", "countertop", "sinkbasin"),
    "fork": ("drawer", "countertop", "diningtable"),
    "book": ("shelf", "desk", "sidetable", "diningtable"),
    "cd": ("shelf", "desk", "drawer", "sidetable"),
    "pen": ("desk", "drawer", "sidetable", "shelf"),
    "pencil": ("desk", "drawer", "shelf"),
    "keychain": ("drawer", "sidetable", "shelf", "desk"),
    "cellphone": ("desk", "sidetable", "drawer", "diningtable"),
    "creditcard": ("drawer", "desk", "sidetable", "countertop"),
    "vase": ("shelf", "sidetable", "diningtable", "cabinet"),
    "statue": ("shelf", "sidetable", "desk"),
    "alarmclock": ("desk", "sidetable", "shelf"),
}
_FOOD = ("apple", "bread", "egg", "lettuce", "potato", "tomato")
_DISHES = ("mug", "cup", "bowl", "plate")
GOAL_OBJECTS: dict[str, tuple[str, ...]] = {
    "pick_place": tuple(OBJECT_HOMES),
    "clean": (*_DISHES, "pan", "knife", "spoon", "fork", "apple", "lettuce", "potato", "tomato"),
    "heat": (*_FOOD, *_DISHES),
    "cool": (*_FOOD, *_DISHES, "pan"),
    "look_in_light": (
        "book",
        "cd",
        "pen",
        "pencil",
        "keychain",
        "cellphone",
        "creditcard",
        "vase",
        "statue",
        "alarmclock",
        "mug",
        "bowl",
    ),
    "pick_two": tuple(OBJECT_HOMES),
}
# Receptacle counts are at most this, and so are object instances of one type.
MAX_NUMBER = 5
MAX_PER_OBJECT_TYPE = 3
LAMP = "desklamp 1"
_LAMP_TABLES = ("desk", "sidetable")  # the lamp stands on one of these
_SMALL_ROOM = ("cabinet", "countertop", "drawer", "fridge", "microwave", "shelf", "sinkbasin")
SINK, MICROWAVE, FRIDGE = "sinkbasin 1", "microwave 1", "fridge 1"
VERBS = (
    "go",
    "to",
    "open",
    "close",
    "take",
    "from",
    "put",
    "in/on",
    "in",
    "on",
    "clean",
    "heat",
    "cool",
    "with",
    "use",
    "examine",
    "inventory",
    "look",
)
NOTHING_HAPPENS = "Nothing happens."
_PUT = re.compile(r"^(?:put|move|place) (.+?) (?:in/on|in|on|into|onto|to) (.+)$")


@dataclass(frozen=True)
class Goal:
    """What the task asks: `count` objects of type `obj` with `prop` (clean/hot/cool)
    in a receptacle of type `target`; or, for look_in_light, `obj` held under the lit lamp."""

    kind: str
    obj: str
    target: str | None
    text: str

    @property
    def prop(self) -> str | None:
        return {"clean": "clean", "heat": "hot", "cool": "cool"}.get(self.kind)

    @property
    def count(self) -> int:
        return 2 if self.kind == "pick_two" else 1


@dataclass(frozen=True)
class Layout:
    """What a task fixes and no command changes."""

    receptacles: tuple[str, ...]  # sorted by (type, number)
    objects: tuple[str, ...]
    lamp_at: str
    goal: Goal


@dataclass
class World:
    """What commands change."""

    location: str | None  # None: the middle of the room, where an episode starts
    holding: str | None
    where: dict[str, str]  # object -> receptacle, for objects not held
    is_open: dict[str, bool]  # openable receptacles only
    props: dict[str, set[str]] = field(default_factory=dict)  # object -> {clean, hot, cool}
    lamp_on: bool = False

    def copy(self) -> World:
        props = {o: set(p) for o, p in self.props.items()}
        return World(
            self.location, self.holding, dict(self.where), dict(self.is_open), props, self.lamp_on
        )


def _kind(name: str) -> str:
    return name.rsplit(" ", 1)[0]


def _sort_key(name: str) -> tuple[str, int]:
    kind, number = name.rsplit(" ", 1)
    return kind, int(number)


def _article(name: str) -> str:
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"


def _listing(names: list[str]) -> str:
    items = [_article(n) for n in names]
    if len(items) <= 1:
        return items[0] if items else "nothing"
    return f"{', '.join(items[:-1])}, and {items[-1]}"


def _plural(obj: str) -> str:
    return {"knife": "knives", "potato": "potatoes", "tomato": "tomatoes"}.get(obj, obj + "s")


ROOMS = ("full", "small")


def generate(
    seed: int, goals: tuple[str, ...] = GOAL_KINDS, room: str = "full"
) -> tuple[Layout, World]:
    """The task and starting world of `seed`: the goal is never already met at the start.

    `goals`: the task kinds drawn from. `room = "small"`: one of each receptacle type
    (eight receptacles: no optional ones) and 2–4 distractor objects, for small policies."""
    rng = random.Random(seed)
    if room == "small":
        lamp_type = rng.choice(_LAMP_TABLES)
        return _populate(rng, dict.fromkeys((*_SMALL_ROOM, lamp_type), 1), lamp_type, goals, (2, 4))
    counts = {
        "cabinet": rng.randint(2, MAX_NUMBER),
        "countertop": rng.randint(1, 2),
        "drawer": rng.randint(1, 3),
        "fridge": 1,
        "microwave": 1,
        "sinkbasin": 1,
        "shelf": rng.randint(1, 2),
    }
    lamp_type = rng.choice(_LAMP_TABLES)
    counts[lamp_type] = 1
    for optional, chance in (
        ("desk", 0.5),
        ("sidetable", 0.5),
        ("diningtable", 0.6),
        ("garbagecan", 0.5),
    ):
        if optional not in counts and rng.random() < chance:
            counts[optional] = 1
    return _populate(rng, counts, lamp_type, goals, (4, 8))


def _populate(
    rng: random.Random,
    counts: dict[str, int],
    lamp_type: str,
    goals: tuple[str, ...],
    distractors: tuple[int, int],
) -> tuple[Layout, World]:
    """Receptacles from `counts`, a goal of one of `goals`, objects and open doors."""
    receptacles = tuple(
        f"{t} {i}" for t in RECEPTACLE_TYPES if t in counts for i in range(1, counts[t] + 1)
    )

    def somewhere(types: list[str]) -> str:
        kind = rng.choice(types)
        return f"{kind} {rng.randint(1, counts[kind])}"

    kind = rng.choice(goals)
    obj = rng.choice(GOAL_OBJECTS[kind])
    homes = [t for t in OBJECT_HOMES[obj] if t in counts]
    target: str | None = None
    if kind != "look_in_light":  # goal objects start away from every target-type receptacle
        target = rng.choice([t for t in STORAGE if t in counts and set(homes) - {t}])
        homes = [t for t in homes if t != target]
    goal = Goal(kind, obj, target, _goal_text(kind, obj, target))

    where: dict[str, str] = {}
    per_type = {o: 0 for o in OBJECT_HOMES}

    def place(obj_type: str, receptacle: str) -> None:
        per_type[obj_type] += 1
        where[f"{obj_type} {per_type[obj_type]}"] = receptacle

    for _ in range(goal.count):
        place(obj, somewhere(homes))
    for _ in range(rng.randint(*distractors)):  # distractors, never of the goal's type
        others = [o for o, n in per_type.items() if o != obj and n < MAX_PER_OBJECT_TYPE]
        other = rng.choice(others)
        place(other, somewhere([t for t in OBJECT_HOMES[other] if t in counts]))
    is_open = {
        r: _kind(r) in ("cabinet", "drawer") and rng.random() < 0.25
        for r in receptacles
        if _kind(r) in OPENABLE
    }
    layout = Layout(receptacles, tuple(sorted(where, key=_sort_key)), f"{lamp_type} 1", goal)
    return layout, World(None, None, where, is_open)


def _goal_text(kind: str, obj: str, target: str | None) -> str:
    where = f"{'in' if target in _INSIDE else 'on'} {target}"
    return {
        "pick_place": f"put {_article(obj)} {where}.",
        "clean": f"put a clean {obj} {where}.",
        "heat": f"put a hot {obj} {where}.",
        "cool": f"put a cool {obj} {where}.",
        "look_in_light": f"look at {_article(obj)} under the desklamp.",
        "pick_two": f"find two {_plural(obj)} and put them {where}.",
    }[kind]


def goal_met(layout: Layout, world: World) -> bool:
    goal = layout.goal
    if goal.kind == "look_in_light":
        held = world.holding is not None and _kind(world.holding) == goal.obj
        return held and world.lamp_on and world.location == layout.lamp_at
    prop = goal.prop
    placed = [
        o
        for o, r in world.where.items()
        if _kind(o) == goal.obj
        and _kind(r) == goal.target
        and (prop is None or prop in world.props.get(o, ()))
    ]
    return len(placed) >= goal.count


def contents(layout: Layout, world: World, receptacle: str) -> list[str]:
    found = [o for o, r in world.where.items() if r == receptacle]
    if receptacle == layout.lamp_at:
        found.append(LAMP)
    return sorted(found, key=_sort_key)


def describe(layout: Layout, world: World, receptacle: str) -> str:
    if receptacle in world.is_open and not world.is_open[receptacle]:
        return f"The {receptacle} is closed."
    listing = _listing(contents(layout, world, receptacle))
    if receptacle in world.is_open:
        return f"The {receptacle} is open. In it, you see {listing}."
    return f"On the {receptacle}, you see {listing}."


def admissible(layout: Layout, world: World) -> tuple[str, ...]:
    """Every valid command in `world`, in a fixed order."""
    here, held = world.location, world.holding
    commands = [f"go to {r}" for r in layout.receptacles if r != here]
    if here is not None:
        reachable = world.is_open.get(here, True)
        if here in world.is_open:
            commands.append(f"{'close' if reachable else 'open'} {here}")
        if reachable and held is None:
            commands += [
                f"take {o} from {here}" for o in contents(layout, world, here) if o != LAMP
            ]
        if reachable and held is not None:
            commands.append(f"put {held} in/on {here}")
        for verb, appliance in (("clean", SINK), ("heat", MICROWAVE), ("cool", FRIDGE)):
            if held is not None and here == appliance:
                commands.append(f"{verb} {held} with {appliance}")
        if here == layout.lamp_at:
            commands.append(f"use {LAMP}")
        commands.append(f"examine {here}")
    commands += ["inventory", "look"]
    return tuple(commands)


def apply(layout: Layout, world: World, command: str) -> str:
    """Carry out an admissible `command` on `world` and say what happened."""
    verb, _, rest = command.partition(" ")
    if verb == "go":
        world.location = rest[len("to ") :]
        return f"You arrive at {world.location}. {describe(layout, world, world.location)}"
    if verb in ("open", "close"):
        world.is_open[rest] = verb == "open"
        if verb == "close":
            return f"You close the {rest}."
        return f"You open the {rest}. In it, you see {_listing(contents(layout, world, rest))}."
    if verb == "take":
        obj, _, receptacle = rest.partition(" from ")
        del world.where[obj]
        world.holding = obj
        return f"You pick up the {obj} from the {receptacle}."
    if verb == "put":
        obj, _, receptacle = rest.partition(" in/on ")
        world.where[obj] = receptacle
        world.holding = None
        return f"You put the {obj} in/on the {receptacle}."
    if verb in ("clean", "heat", "cool"):
        obj, _, appliance = rest.partition(" with ")
        props = world.props.setdefault(obj, set())
        if verb == "clean":
            props.add("clean")
        else:  # heating undoes cooling and the reverse, as in ALFWorld
            props.discard("cool" if verb == "heat" else "hot")
            props.add("hot" if verb == "heat" else "cool")
        return f"You {verb} the {obj} using the {appliance}."
    if verb == "use":
        world.lamp_on = not world.lamp_on
        return f"You turn {'on' if world.lamp_on else 'off'} the {LAMP}."
    if verb == "examine":
        return describe(layout, world, rest)
    if verb == "inventory":
        return (
            f"You are carrying: {world.holding}."
            if world.holding
            else "You are not carrying anything."
        )
    if world.location is None:  # look
        return f"You are in the middle of a room. Looking around, you see {_listing(list(layout.receptacles))}."
    return f"You are facing the {world.location}. {describe(layout, world, world.location)}"


def state_key(layout: Layout, world: World) -> str:
    """Canonical text of `world`: equal for equal worlds, whatever happened before."""
    lines = [f"at: {world.location or 'middle of room'}", f"holding: {world.holding or 'nothing'}"]
    inside: dict[str, list[str]] = {r: [] for r in layout.receptacles}
    for obj, receptacle in world.where.items():
        inside[receptacle].append(obj)
    for r in layout.receptacles:
        state = ("open" if world.is_open[r] else "closed") if r in world.is_open else "fixed"
        lines.append(f"{r} ({state}): {', '.join(sorted(inside[r], key=_sort_key)) or 'nothing'}")
    for obj in layout.objects:
        if props := world.props.get(obj):
            lines.append(f"{obj}: {' '.join(sorted(props))}")
    lines.append(f"{LAMP}: {'on' if world.lamp_on else 'off'}")
    return "\n".join(lines)


def expert_plan(layout: Layout, start: World) -> list[str]:
    """A scripted solution: fetch each goal object, treat it, deliver it (or light it)."""
    world, plan = start.copy(), []

    def do(command: str) -> None:
        if command not in admissible(layout, world):
            raise RuntimeError(f"expert command {command!r} is not admissible")
        apply(layout, world, command)
        plan.append(command)

    def go_and_open(receptacle: str) -> None:
        if world.location != receptacle:
            do(f"go to {receptacle}")
        if world.is_open.get(receptacle) is False:
            do(f"open {receptacle}")

    goal = layout.goal
    wanted = [o for o in layout.objects if _kind(o) == goal.obj][: goal.count]
    target = next((r for r in layout.receptacles if _kind(r) == goal.target), None)
    appliance = {"clean": SINK, "heat": MICROWAVE, "cool": FRIDGE}.get(goal.kind)
    for obj in wanted:
        source = world.where[obj]
        go_and_open(source)
        do(f"take {obj} from {source}")
        if appliance is not None:
            if world.location != appliance:  # appliances work closed, as in ALFWorld
                do(f"go to {appliance}")
            do(f"{goal.kind} {obj} with {appliance}")
        if target is None:  # look_in_light
            if world.location != layout.lamp_at:
                do(f"go to {layout.lamp_at}")
            do(f"use {LAMP}")
        else:
            go_and_open(target)
            do(f"put {obj} in/on {target}")
    return plan


def canonical(reply: str) -> str:
    """The command a reply names, in the admissible-list spelling where an alias is used."""
    command = " ".join(w for w in normalise_command(reply).split() if w not in ("the", "a", "an"))
    if match := _PUT.match(command):
        return f"put {match[1]} in/on {match[2]}"
    return command


class Household:
    """ALFWorld-like household tasks; reward 1 and done on completing the goal."""

    name = "household"
    revision = 1  # 1: the task is restated in every observation (warm-start caches key on it)

    def __init__(
        self, max_turns: int = 30, *, goals: tuple[str, ...] = GOAL_KINDS, room: str = "full"
    ) -> None:
        """`goals`: the task kinds to draw (any of GOAL_KINDS); `room`: "full" (ALFWorld-sized,
        9–17 receptacles) or "small" (one of each type, eight in all, fewer objects)."""
        if max_turns < 1:
            raise GagpoError(f"max_turns must be at least 1, got {max_turns}")
        goals = tuple(goals)
        unknown = sorted(set(goals) - set(GOAL_KINDS))
        if not goals or unknown:
            raise GagpoError(
                f"household goals {unknown or '[]'} not accepted; accepted: one or more of {', '.join(GOAL_KINDS)}"
            )
        if room not in ROOMS:
            raise GagpoError(f"household room {room!r} not accepted; accepted: {', '.join(ROOMS)}")
        self.max_turns = max_turns
        self.goals = goals
        self.room = room
        self._layout: Layout | None = None
        self._world: World | None = None
        self._plan: list[str] = []
        self._admissible: tuple[str, ...] = ()
        self._turn = 0
        self._over = True

    @property
    def goal(self) -> Goal | None:
        """The current task's goal (None before the first reset)."""
        return self._layout.goal if self._layout is not None else None

    def reset(self, task_seed: int) -> Reset:
        self._layout, self._world = generate(task_seed, self.goals, self.room)
        self._plan = expert_plan(self._layout, self._world)
        self._admissible = admissible(self._layout, self._world)
        self._turn = 0
        self._over = False
        room = apply(self._layout, self._world.copy(), "look")
        observation = f"{room}\n\nYour task is to: {self._layout.goal.text}"
        return Reset(observation, state_key(self._layout, self._world), self._admissible)

    def step(self, reply: str) -> Transition:
        layout, world = self._layout, self._world
        if self._over or layout is None or world is None:
            raise RuntimeError("the household episode is over (or never began); call reset() first")
        before = state_key(layout, world)
        command = canonical(reply)
        self._turn += 1
        valid = command in self._admissible
        done = False
        if valid:
            observation = apply(layout, world, command)
            done = goal_met(layout, world)
            reward = 1.0 if done else 0.0
            self._admissible = () if done else admissible(layout, world)
            after = state_key(layout, world)
            if done:
                observation += " You have completed the task."
        else:
            observation, reward, after = NOTHING_HAPPENS, INVALID_ACTION_PENALTY, before
        if not done:  # the task is restated every turn: the prompt keeps few earlier turns
            observation += f"\n\nYour task is to: {layout.goal.text}"
        truncated = not done and self._turn >= self.max_turns
        self._over = done or truncated
        return Transition(
            observation=observation,
            state_key=before,
            next_state_key=None if done else after,
            reward=reward,
            done=done,
            truncated=truncated,
            action_valid=valid,
            admissible=self._admissible,
            won=done,  # the episode ends only when the goal is met
        )

    @property
    def instructions(self) -> str:
        return (
            "You are in a household and must complete a task. Commands: go to R, open R, "
            "close R, take O from R, put O in/on R, clean O with sinkbasin 1, heat O with "
            "microwave 1, cool O with fridge 1, use desklamp 1, examine R, inventory, look "
            "(R is a receptacle such as cabinet 2, O an object such as mug 1). You carry one "
            "object at a time; open a closed receptacle before taking from it or putting into "
            "it. Completing the task earns 1; a command that cannot be carried out changes "
            "nothing and costs 0.1. Reply with exactly one command."
        )

    def expert_plan(self) -> list[str] | None:
        """Scripted commands that solve the current task from its start."""
        return list(self._plan) if self._layout is not None else None

    def replan(self) -> list[str] | None:
        """Scripted commands that solve the task from the current state (for noisy
        demonstrations, actors/demos.py): put down what is held, then the usual script."""
        layout, world = self._layout, self._world
        if layout is None or world is None:
            return None
        world, prefix = world.copy(), []
        if world.holding is not None:
            here = world.location or layout.receptacles[0]
            steps = [] if world.location else [f"go to {here}"]
            steps += ["open " + here] if world.is_open.get(here) is False else []
            for command in (*steps, f"put {world.holding} in/on {here}"):
                apply(layout, world, command)
                prefix.append(command)
        try:
            return prefix + expert_plan(layout, world)
        except RuntimeError:  # a state the script does not cover
            return None

    @classmethod
    def vocabulary(cls) -> list[str]:
        words = {*VERBS, *RECEPTACLE_TYPES, *OBJECT_HOMES, _kind(LAMP)}
        words |= {str(n) for n in range(1, MAX_NUMBER + 1)}
        return sorted(words)
