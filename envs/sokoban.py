"""A Sokoban-like grid puzzle, generated from a seed.

Levels are made by playing backwards from a solved state (the player walks and pulls
boxes off their targets), so every level can be solved by replaying the pulls as
pushes; a breadth-first search over (player, boxes) states then confirms it and gives
a shortest solution, which is the expert plan. Rewards follow the Sokoban used by
RAGEN and GiGPO: -0.1 per move, +1 for pushing a box onto a target, -1 for pushing
one off, +10 for solving. The state key is the grid itself: the grid is the whole
state, so rollouts that reach the same grid share a key whatever path they took.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass
from functools import cache

from gagpo.envs.base import INVALID_ACTION_PENALTY, Reset, Transition
from gagpo.envs.parse import normalise_command, parse_action
from gagpo.schemas.errors import GagpoError

WALL, FLOOR, TARGET, BOX, BOX_ON_TARGET, PLAYER, PLAYER_ON_TARGET = "#_.$*@+"
MOVES = ("up", "down", "left", "right")
STEP_PENALTY = -0.1
BOX_ON_TARGET_REWARD = 1.0
BOX_OFF_TARGET_PENALTY = -1.0
SOLVED_REWARD = 10.0
# Shortest-solution lengths a generated level must have: at least a few moves so a
# level is a puzzle, few enough that a small policy within 30 turns can solve it.
MIN_SOLUTION, MAX_SOLUTION = 3, 20
_PREFIXES = ("move ", "go ", "push ", "walk ")
_MAX_ATTEMPTS = 10_000


@dataclass(frozen=True)
class Level:
    """A grid of `height` x `width` cells (border walls included); cells are numbered
    row * width + column, so a move is adding one of `deltas(width)`."""

    height: int
    width: int
    walls: frozenset[int]
    targets: frozenset[int]
    boxes: frozenset[int]
    player: int


def deltas(width: int) -> dict[str, int]:
    """Cell-number offset of each move on a grid `width` cells wide."""
    return {"up": -width, "down": width, "left": -1, "right": 1}


def render(level: Level) -> str:
    """The grid as text, one row per line (legend in `Sokoban.instructions`)."""
    rows = []
    for r in range(level.height):
        row = []
        for cell in range(r * level.width, (r + 1) * level.width):
            on_target = cell in level.targets
            if cell in level.walls:
                row.append(WALL)
            elif cell == level.player:
                row.append(PLAYER_ON_TARGET if on_target else PLAYER)
            elif cell in level.boxes:
                row.append(BOX_ON_TARGET if on_target else BOX)
            else:
                row.append(TARGET if on_target else FLOOR)
        rows.append("".join(row))
    return "\n".join(rows)


def parse_grid(grid: str) -> Level:
    """The level a `render`ed grid (a step's `state_key`) shows: the inverse of `render`."""
    rows = grid.split("\n")
    width = len(rows[0])
    cells = "".join(rows)
    if any(len(row) != width for row in rows) or set(cells) - set(
        WALL + FLOOR + TARGET + BOX + BOX_ON_TARGET + PLAYER + PLAYER_ON_TARGET
    ):
        raise ValueError(f"not a Sokoban grid: {grid!r}")

    def where(*kinds: str) -> frozenset[int]:
        return frozenset(i for i, ch in enumerate(cells) if ch in kinds)

    players = where(PLAYER, PLAYER_ON_TARGET)
    if len(players) != 1:
        raise ValueError(f"a Sokoban grid has one player: {grid!r}")
    return Level(
        len(rows),
        width,
        where(WALL),
        where(TARGET, BOX_ON_TARGET, PLAYER_ON_TARGET),
        where(BOX, BOX_ON_TARGET),
        next(iter(players)),
    )


_CELL_WORDS = {WALL: "wall", FLOOR: "floor", TARGET: "target", BOX: "box", BOX_ON_TARGET: "box"}


def _offset(width: int, frm: int, to: int) -> str:
    """Where cell `to` lies from cell `frm`, in words: e.g. `up 1 right 2` (`here` if same)."""
    dy, dx = to // width - frm // width, to % width - frm % width
    parts = [f"{'down' if dy > 0 else 'up'} {abs(dy)}"] if dy else []
    parts += [f"{'right' if dx > 0 else 'left'} {abs(dx)}"] if dx else []
    return " ".join(parts) or "here"


def describe(level: Level) -> str:
    """The grid in words around the player: what each neighbouring cell holds, and where
    each box still off a target and the nearest free target lie. A word-level policy
    reads this far more easily than the grid's positions (docs/environments.md)."""
    grid = render(level).replace("\n", "")
    near = [
        f"{move}: {_CELL_WORDS.get(grid[level.player + d], 'floor')}"
        for move, d in deltas(level.width).items()
    ]
    lines = [". ".join(near) + "."]
    free = sorted(level.targets - level.boxes)
    for box in sorted(level.boxes - level.targets):
        lines.append(f"box: {_offset(level.width, level.player, box)}.")
        if free:
            nearest = min(
                free,
                key=lambda t: (
                    abs(t // level.width - box // level.width)
                    + abs(t % level.width - box % level.width),
                    t,
                ),
            )
            lines.append(f"target from box: {_offset(level.width, box, nearest)}.")
    return "\n".join(lines)


def push(level: Level, move: str) -> Level:
    """The level after `move`; walking into a wall or an immovable box changes nothing."""
    d = deltas(level.width)[move]
    ahead = level.player + d
    if ahead in level.walls:
        return level
    boxes = level.boxes
    if ahead in boxes:
        beyond = ahead + d
        if beyond in level.walls or beyond in boxes:
            return level
        boxes = (boxes - {ahead}) | {beyond}
    return Level(level.height, level.width, level.walls, level.targets, boxes, ahead)


def solve(level: Level, max_moves: int) -> list[str] | None:
    """A shortest move sequence that puts every box on a target, or None if there is
    none within `max_moves` (breadth-first over (player, sorted boxes))."""
    if level.boxes <= level.targets:
        return []
    moves = deltas(level.width)
    walls, targets = level.walls, level.targets
    start = (level.player, tuple(sorted(level.boxes)))
    parent: dict[tuple[int, tuple[int, ...]], tuple[tuple[int, tuple[int, ...]], str] | None]
    parent = {start: None}
    frontier = deque([(start, 0)])
    while frontier:
        state, depth = frontier.popleft()
        if depth == max_moves:
            continue
        player, boxes = state
        for name, d in moves.items():
            ahead = player + d
            if ahead in walls:
                continue
            if ahead in boxes:
                beyond = ahead + d
                if beyond in walls or beyond in boxes:
                    continue
                boxes_next = tuple(sorted(beyond if b == ahead else b for b in boxes))
            else:
                boxes_next = boxes
            nxt = (ahead, boxes_next)
            if nxt in parent:
                continue
            parent[nxt] = (state, name)
            if all(b in targets for b in boxes_next):
                plan = []
                link = parent[nxt]
                while link is not None:
                    state_before, move = link
                    plan.append(move)
                    link = parent[state_before]
                return plan[::-1]
            frontier.append((nxt, depth + 1))
    return None


def generate(seed: int, sizes: tuple[int, int], max_boxes: int) -> tuple[Level, list[str]]:
    """A solvable level and a shortest solution, both determined by `seed`."""
    rng = random.Random(seed)
    for _ in range(_MAX_ATTEMPTS):
        height, width = rng.randint(*sizes), rng.randint(*sizes)
        cells = range(height * width)
        border = {c for c in cells if c // width in (0, height - 1) or c % width in (0, width - 1)}
        interior = [c for c in cells if c not in border]
        walls = border | set(rng.sample(interior, rng.randint(0, 2)))
        floor = [c for c in interior if c not in walls]
        if not _connected(floor, width):
            continue
        n_boxes = 1 if max_boxes == 1 or rng.random() < 0.7 else rng.randint(2, max_boxes)
        targets = set(rng.sample(floor, n_boxes))
        boxes = set(targets)
        player = rng.choice([c for c in floor if c not in boxes])
        moves = list(deltas(width).values())
        for _ in range(rng.randint(8, 30)):  # play backwards: walk, sometimes pulling a box
            d = rng.choice(moves)
            ahead, behind = player + d, player - d
            if ahead in walls or ahead in boxes:
                continue
            if behind in boxes and rng.random() < 0.8:
                boxes.remove(behind)
                boxes.add(player)
            player = ahead
        if boxes == targets:
            continue
        level = Level(height, width, frozenset(walls), frozenset(targets), frozenset(boxes), player)
        plan = solve(level, MAX_SOLUTION)
        if plan is not None and len(plan) >= MIN_SOLUTION:
            return level, plan
    raise RuntimeError(f"no Sokoban level found for seed {seed} in {_MAX_ATTEMPTS} attempts")


def _connected(floor: list[int], width: int) -> bool:
    """Whether every floor cell can be walked to from every other."""
    cells = set(floor)
    seen = {floor[0]}
    stack = [floor[0]]
    while stack:
        c = stack.pop()
        for d in (-width, width, -1, 1):
            if c + d in cells and c + d not in seen:
                seen.add(c + d)
                stack.append(c + d)
    return len(seen) == len(cells)


def parse_move(reply: str) -> str | None:
    """The move a reply names ("up", "Move left.", "Action: down"), or None."""
    command = normalise_command(reply)
    for prefix in _PREFIXES:
        if command.startswith(prefix):
            command = command[len(prefix) :].strip()
            break
    return command if command in MOVES else None


ORACLE_HORIZON = 16  # moves; the demo's levels (3×3 floor, one box) need at most ~10


@cache
def moves_to_go(grid: str) -> int | None:
    """Length of a shortest solution from this grid (0: solved), or None: unsolvable within
    ORACLE_HORIZON moves."""
    plan = solve(parse_grid(grid), ORACLE_HORIZON)
    return None if plan is None else len(plan)


@cache
def optimal_moves(grid: str) -> frozenset[str]:
    """The moves that start a shortest solution from this grid (empty if none is left)."""
    n = moves_to_go(grid)
    if not n:
        return frozenset()
    level = parse_grid(grid)
    return frozenset(m for m in MOVES if moves_to_go(render(push(level, m))) == n - 1)


class Sokoban:
    """Push every box onto a target. Moves into walls or stuck boxes are valid no-ops
    (they cost the step penalty, like in RAGEN); replies that name no move are invalid.
    Its exact solver is a step oracle (base.StepOracle): the state key is the grid."""

    name = "sokoban"

    @classmethod
    def optimal_moves(cls, state_key: str) -> frozenset[str]:
        return optimal_moves(state_key)

    @classmethod
    def parse_move(cls, reply: str) -> str | None:
        move = parse_action(reply, MOVES)
        return move if move in MOVES else None

    def __init__(
        self,
        max_turns: int = 30,
        *,
        sizes: tuple[int, int] = (6, 7),
        max_boxes: int = 2,
        describe: bool = False,
    ) -> None:
        """`sizes`: smallest and largest grid side, border walls included (RAGEN's
        6x6 has a 4x4 interior); `max_boxes`: a level has 1 box, sometimes up to this;
        `describe`: observations add the player's surroundings and the boxes' and targets'
        offsets in words (the state key stays the grid)."""
        if max_turns < 1:
            raise GagpoError(f"max_turns must be at least 1, got {max_turns}")
        if not 5 <= sizes[0] <= sizes[1]:
            raise GagpoError(f"sizes must be (low, high) with 5 <= low <= high, got {sizes}")
        if max_boxes < 1:
            raise GagpoError(f"max_boxes must be at least 1, got {max_boxes}")
        self.max_turns = max_turns
        self.sizes = sizes
        self.max_boxes = max_boxes
        self.describe = describe
        self._level: Level | None = None
        self._plan: list[str] = []
        self._turn = 0
        self._over = True

    def reset(self, task_seed: int) -> Reset:
        self._level, self._plan = generate(task_seed, self.sizes, self.max_boxes)
        self._turn = 0
        self._over = False
        grid = render(self._level)
        observation = f"Goal: push every box ($) onto a target (.).\n{self._view(self._level)}"
        return Reset(observation=observation, state_key=grid, admissible=MOVES)

    def _view(self, level: Level) -> str:
        """What the agent sees of `level`: the grid, and its description when asked for."""
        grid = render(level)
        return f"{grid}\n{describe(level)}" if self.describe else grid

    def step(self, reply: str) -> Transition:
        if self._over or self._level is None:
            raise RuntimeError("the Sokoban episode is over (or never began); call reset() first")
        before = self._level
        state_key = render(before)
        move = parse_move(reply)
        self._turn += 1
        done = False
        if move is None:
            reward, valid = INVALID_ACTION_PENALTY, False
            observation = (
                f"Invalid action. Reply with one of: {', '.join(MOVES)}.\n{self._view(before)}"
            )
            next_key = state_key
        else:
            after = push(before, move)
            self._level = after
            valid = True
            on_before = len(before.boxes & before.targets)
            on_after = len(after.boxes & after.targets)
            reward = STEP_PENALTY
            if on_after > on_before:
                reward += BOX_ON_TARGET_REWARD
            elif on_after < on_before:
                reward += BOX_OFF_TARGET_PENALTY
            done = after.boxes <= after.targets
            if done:
                reward += SOLVED_REWARD
            next_key = render(after)
            observation = self._view(after) + ("\nSolved!" if done else "")
        truncated = not done and self._turn >= self.max_turns
        self._over = done or truncated
        return Transition(
            observation=observation,
            state_key=state_key,
            next_state_key=None if done else next_key,
            reward=reward,
            done=done,
            truncated=truncated,
            action_valid=valid,
            admissible=() if done else MOVES,
            won=done,  # the only way a Sokoban episode ends is solving it
        )

    @property
    def instructions(self) -> str:
        return (
            "You are playing Sokoban on a grid. Legend: # wall, _ floor, . target, $ box, "
            "* box on a target, @ you, + you on a target. Moves: up, down, left, right. "
            "Walking into a box pushes it one cell if the cell beyond is free; boxes cannot "
            "be pulled. Push every box onto a target to win. Each move costs 0.1, pushing a "
            "box onto a target earns 1, pushing one off costs 1, solving earns 10. "
            "Reply with exactly one command."
        )

    def expert_plan(self) -> list[str] | None:
        """A shortest solution of the current level from its start."""
        return list(self._plan) if self._level is not None else None

    def replan(self) -> list[str] | None:
        """A shortest solution from the current state (for noisy demonstrations, actors/
        demos.py); None when none is within reach (a box pushed into a corner)."""
        return solve(self._level, MAX_SOLUTION) if self._level is not None else None

    @classmethod
    def vocabulary(cls) -> list[str]:
        return [*MOVES, "wall", "floor", "target", "box", "from", "here"]
