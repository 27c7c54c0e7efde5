"""PDDL problems for ALFWorld's domain, generated from a seed for its six task types.

A problem is a room of one of four kinds (kitchen, living room, bedroom, bathroom, as
in ALFRED) with receptacles at their own locations, objects inside them, and a goal
from ALFWorld's goal library. What the world allows comes from ALFWorld itself
(`Knowledge.from_alfworld`): which receptacle types can hold which object types, which
objects can be cleaned, heated, cooled or switched on, which receptacles open. This
module only decides what a room holds; the rooms' receptacle and object types are
listed here, so the vocabulary is known without ALFWorld installed.

Entities are named as in ALFWorld's game files (`Apple_bar_1`, `Sink_bar_1_bar_SinkBasin`)
so that ALFWorld's demangler turns them into "apple 1" and "sinkbasin 1". Goals are
never met at the start: goal objects start away from every receptacle of the target
type, and every goal object can reach a target (the planner then confirms it).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

TASK_TYPES = (
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
)
# Task type -> the property its object needs and the receptacle type that gives it.
TREATMENTS = {
    "pick_clean_then_place_in_recep": ("cleanable", "SinkBasin"),
    "pick_heat_then_place_in_recep": ("heatable", "Microwave"),
    "pick_cool_then_place_in_recep": ("coolable", "Fridge"),
}
LAMP = "DeskLamp"
LAMP_HOLDERS = ("Desk", "SideTable", "Dresser")
# Type constants ALFWorld's domain names in its actions: a problem declares them all.
DOMAIN_RTYPES = ("SinkBasin", "Microwave", "Fridge")
DOMAIN_OTYPES = ("Knife", "ButterKnife")
MAX_PER_TYPE = 3  # instances of one object type, as ALFRED's MAX_NUM_OF_OBJ_INSTANCES
DISTRACTORS = (4, 10)
_MAX_ATTEMPTS = 1_000


@dataclass(frozen=True)
class Scene:
    """A kind of room: receptacle type -> (fewest, most) instances, and its object types."""

    receptacles: dict[str, tuple[int, int]]
    objects: tuple[str, ...]


SCENES: dict[str, Scene] = {
    "kitchen": Scene(
        {
            "Cabinet": (2, 6),
            "CounterTop": (1, 2),
            "Drawer": (1, 4),
            "Fridge": (1, 1),
            "Microwave": (1, 1),
            "SinkBasin": (1, 1),
            "StoveBurner": (2, 4),
            "GarbageCan": (1, 1),
            "CoffeeMachine": (1, 1),
            "DiningTable": (0, 1),
            "Shelf": (0, 2),
        },
        (
            "Apple",
            "Bread",
            "Egg",
            "Lettuce",
            "Potato",
            "Tomato",
            "Mug",
            "Cup",
            "Bowl",
            "Plate",
            "Pan",
            "Pot",
            "Kettle",
            "Knife",
            "ButterKnife",
            "Fork",
            "Spoon",
            "Spatula",
            "Ladle",
            "DishSponge",
            "SaltShaker",
            "PepperShaker",
            "SoapBottle",
            "WineBottle",
        ),
    ),
    "livingroom": Scene(
        {
            "Sofa": (1, 1),
            "ArmChair": (0, 2),
            "CoffeeTable": (1, 1),
            "SideTable": (1, 2),
            "Shelf": (1, 3),
            "Drawer": (0, 3),
            "Cabinet": (0, 2),
            "TVStand": (1, 1),
            "GarbageCan": (1, 1),
            "Dresser": (0, 1),
            "Ottoman": (0, 1),
        },
        (
            "Book",
            "CellPhone",
            "CreditCard",
            "KeyChain",
            "RemoteControl",
            "Pillow",
            "Newspaper",
            "Laptop",
            "Statue",
            "Vase",
            "Box",
            "Watch",
            "TissueBox",
            "Candle",
            "Bowl",
            "Plate",
        ),
    ),
    "bedroom": Scene(
        {
            "Bed": (1, 1),
            "Desk": (1, 1),
            "Drawer": (1, 4),
            "Dresser": (0, 1),
            "Shelf": (1, 3),
            "SideTable": (1, 2),
            "GarbageCan": (1, 1),
            "LaundryHamper": (0, 1),
            "ArmChair": (0, 1),
        },
        (
            "AlarmClock",
            "Book",
            "CD",
            "CellPhone",
            "CreditCard",
            "KeyChain",
            "Laptop",
            "Pen",
            "Pencil",
            "Pillow",
            "Mug",
            "Bowl",
            "Cloth",
            "BaseballBat",
            "TennisRacket",
            "BasketBall",
            "Watch",
        ),
    ),
    "bathroom": Scene(
        {
            "BathtubBasin": (0, 1),
            "SinkBasin": (1, 2),
            "Toilet": (1, 1),
            "Cabinet": (1, 4),
            "CounterTop": (1, 1),
            "Drawer": (0, 2),
            "GarbageCan": (1, 1),
            "Shelf": (0, 2),
            "TowelHolder": (0, 1),
            "HandTowelHolder": (0, 1),
            "ToiletPaperHanger": (1, 1),
            "Cart": (0, 1),
        },
        (
            "SoapBar",
            "SoapBottle",
            "SprayBottle",
            "ToiletPaper",
            "Cloth",
            "Candle",
            "DishSponge",
            "HandTowel",
            "Towel",
            "Plunger",
            "TissueBox",
        ),
    ),
}
# Task type -> the rooms it is set in (heating and cooling need the kitchen's appliances).
TASK_SCENES = {
    "pick_and_place_simple": tuple(SCENES),
    "look_at_obj_in_light": ("livingroom", "bedroom"),
    "pick_clean_then_place_in_recep": ("kitchen", "bathroom"),
    "pick_heat_then_place_in_recep": ("kitchen",),
    "pick_cool_then_place_in_recep": ("kitchen",),
    "pick_two_obj_and_place": tuple(SCENES),
}


@dataclass(frozen=True)
class Knowledge:
    """What ALFWorld's world allows, by CamelCase type name."""

    can_contain: dict[str, frozenset[str]]  # receptacle type -> object types it holds
    properties: dict[str, frozenset[str]]  # cleanable/heatable/coolable/toggleable/sliceable
    openable: frozenset[str]  # receptacle types that open and close
    receptacle_objects: frozenset[str]  # object types that hold other objects (mugs, bowls)
    goals: dict[str, tuple[str, tuple[str, ...]]]  # task type -> (goal PDDL, descriptions)

    @classmethod
    def from_alfworld(cls) -> Knowledge:
        """Read from the installed `alfworld` package (its generation constants and goal library)."""
        import alfworld.gen.constants as constants
        import alfworld.gen.goal_library as goals

        properties = {
            name.lower(): frozenset(types) for name, types in constants.VAL_ACTION_OBJECTS.items()
        }
        return cls(
            can_contain={r: frozenset(o) for r, o in constants.VAL_RECEPTACLE_OBJECTS.items()},
            properties=properties,
            openable=frozenset(constants.OPENABLE_CLASS_LIST),
            receptacle_objects=frozenset(constants.MOVABLE_RECEPTACLES),
            goals={
                t: (goals.gdict[t]["pddl"], tuple(goals.gdict[t]["templates"])) for t in TASK_TYPES
            },
        )


@dataclass(frozen=True)
class Task:
    """A generated task: what it asks and the PDDL problem that poses it."""

    task_type: str
    scene: str
    obj: str  # goal object type, e.g. "Apple"
    recep: str | None  # target receptacle type; None for look_at_obj_in_light
    toggle: str | None  # the lamp type for look_at_obj_in_light
    description: str  # e.g. "put a hot apple in countertop"
    problem: str


def entity_id(kind: str, number: int) -> str:
    """ALFWorld-style id: `Apple_bar_1`; basins as `Sink_bar_1_bar_SinkBasin`."""
    if kind.endswith("Basin"):
        return f"{kind[: -len('Basin')]}_bar_{number}_bar_{kind}"
    return f"{kind}_bar_{number}"


def generate_task(seed: int, task_type: str, kb: Knowledge) -> Task:
    """The task of `task_type` that `seed` determines."""
    if task_type not in TASK_TYPES:
        raise ValueError(
            f"unknown ALFWorld task type {task_type!r}; accepted: {', '.join(TASK_TYPES)}"
        )
    rng = random.Random(f"alfworld:{task_type}:{seed}")
    for _ in range(_MAX_ATTEMPTS):
        task = _attempt(rng, task_type, kb)
        if task is not None:
            return task
    raise RuntimeError(f"no {task_type} task found for seed {seed} in {_MAX_ATTEMPTS} attempts")


def _attempt(rng: random.Random, task_type: str, kb: Knowledge) -> Task | None:
    scene_name = rng.choice(TASK_SCENES[task_type])
    scene = SCENES[scene_name]
    counts = {t: rng.randint(lo, hi) for t, (lo, hi) in scene.receptacles.items()}
    receptacles = [entity_id(t, i) for t, n in counts.items() for i in range(1, n + 1)]
    kind_of = {r: t for t, n in counts.items() for r in (entity_id(t, i) for i in range(1, n + 1))}
    present = [t for t, n in counts.items() if n > 0]

    def homes(obj: str, avoid: str | None = None) -> list[str]:
        return [
            r
            for r in receptacles
            if obj in kb.can_contain.get(kind_of[r], ()) and kind_of[r] != avoid
        ]

    prop, appliance = TREATMENTS.get(task_type, (None, None))
    look = task_type == "look_at_obj_in_light"
    candidates = [o for o in scene.objects if prop is None or o in kb.properties[prop]]
    if appliance is not None and appliance not in present:
        return None
    obj = rng.choice(candidates)
    recep: str | None = None
    if not look:
        targets = [
            t
            for t in present
            if obj in kb.can_contain.get(t, ()) and t != appliance and homes(obj, avoid=t)
        ]
        if not targets:
            return None
        recep = rng.choice(targets)
    starts = homes(obj, avoid=recep)
    if not starts:
        return None

    contents: dict[str, list[str]] = {r: [] for r in receptacles}  # receptacle -> object ids
    types: dict[str, str] = {}  # object id -> type
    per_type: dict[str, int] = {}

    def place(kind: str, receptacle: str) -> None:
        per_type[kind] = per_type.get(kind, 0) + 1
        oid = entity_id(kind, per_type[kind])
        contents[receptacle].append(oid)
        types[oid] = kind

    wanted = (
        rng.randint(2, MAX_PER_TYPE) if task_type == "pick_two_obj_and_place" else rng.randint(1, 2)
    )
    for _ in range(wanted):
        place(obj, rng.choice(starts))
    toggle = None
    if look:
        holders = [r for r in receptacles if kind_of[r] in LAMP_HOLDERS]
        if not holders:
            return None
        toggle = LAMP
        place(LAMP, rng.choice(holders))
    others = [o for o in scene.objects if o != obj and homes(o)]
    for _ in range(rng.randint(*DISTRACTORS)):
        kinds = [o for o in others if per_type.get(o, 0) < MAX_PER_TYPE]
        if not kinds:
            break
        kind = rng.choice(kinds)
        place(kind, rng.choice(homes(kind)))

    template = rng.choice(kb.goals[task_type][1])
    names = {"obj": obj, "recep": recep or "", "toggle": toggle or ""}
    description = template.format(**{k: v.lower() for k, v in names.items()})
    goal = kb.goals[task_type][0].format(**names).replace("#", "-")
    problem = _problem(kb, receptacles, kind_of, contents, types, goal)
    return Task(task_type, scene_name, obj, recep, toggle, description, problem)


def _problem(
    kb: Knowledge,
    receptacles: list[str],
    kind_of: dict[str, str],
    contents: dict[str, list[str]],
    types: dict[str, str],
    goal: str,
) -> str:
    """PDDL problem text: one location per receptacle, the agent at its own location."""
    location = {r: f"loc_bar_{i}" for i, r in enumerate(receptacles, start=1)}
    rtypes = sorted({*kind_of.values(), *DOMAIN_RTYPES})
    otypes = sorted({*types.values(), *DOMAIN_OTYPES})
    objects = ["agent1 - agent", "loc_bar_0 - location"]
    objects += [f"{loc} - location" for loc in location.values()]
    objects += [f"{r} - receptacle" for r in receptacles]
    objects += [f"{o} - object" for o in types]
    objects += [f"{t}Type - rtype" for t in rtypes] + [f"{t}Type - otype" for t in otypes]

    init = ["(atLocation agent1 loc_bar_0)"]
    for r in receptacles:
        kind = kind_of[r]
        init += [f"(receptacleAtLocation {r} {location[r]})", f"(receptacleType {r} {kind}Type)"]
        if kind in kb.openable:
            init.append(f"(openable {r})")
        for o in contents[r]:
            init += [f"(inReceptacle {o} {r})", f"(objectAtLocation {o} {location[r]})"]
    for o, kind in types.items():
        init.append(f"(objectType {o} {kind}Type)")
        toggleable = kind in kb.properties["toggleable"]
        if not toggleable:
            init.append(f"(pickupable {o})")
        for prop in ("cleanable", "heatable", "coolable", "toggleable", "sliceable"):
            if kind in kb.properties[prop]:
                init.append(f"({prop} {o})")
        if kind in kb.receptacle_objects:
            init.append(f"(isReceptacleObject {o})")
    present_otypes = sorted(set(types.values()))
    for rt in sorted(set(kind_of.values())):
        init += [
            f"(canContain {rt}Type {ot}Type)"
            for ot in present_otypes
            if ot in kb.can_contain.get(rt, ())
        ]
    body = "\n".join(
        [
            "(define (problem gagpo)",
            "(:domain alfred)",
            "(:objects",
            *objects,
            ")",
            "(:init",
            *init,
            ")",
        ]
    )
    return f"{body}\n{goal.strip()}\n"  # the goal library's text closes the `define`


def vocabulary_types() -> list[str]:
    """Every receptacle and object type a generated room can hold, lower-cased as in play."""
    kinds = {LAMP, *DOMAIN_RTYPES}
    for scene in SCENES.values():
        kinds |= set(scene.receptacles) | set(scene.objects)
    return sorted(k.lower() for k in kinds)
