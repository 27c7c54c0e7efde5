"""Conversations whose prompts extend the previous turn, drift, or slide a native history
window, in a store, and the rules of schemas/extends.py read literally in Python: the
references of the drift audit (the `prompt_drift` view, `gagpo view`'s drift marks, the
actor's count; tests/test_drift_audit.py)."""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa

from gagpo.schemas import columns as C
from gagpo.storage.store import Store
from tests.helpers.sql import rollout

SYSTEM = [101, 102, 103]  # the system prompt and task every conversation begins with


# --- conversations, turn by turn -------------------------------------------------------
def keeps_history(turns: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """(prompt_ids, action_ids) per turn of an agent that sends its whole history."""
    rng = random.Random(seed)
    prompt, out = list(SYSTEM), []
    for _ in range(turns):
        prompt = prompt + [rng.randrange(200, 300) for _ in range(rng.randrange(1, 4))]
        action = [rng.randrange(300, 400) for _ in range(rng.randrange(1, 4))]
        out.append((prompt, action))
        prompt = prompt + action
    return out


def drifting(turns: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """A history-keeping conversation whose every turn may drift: the last reply
    re-tokenized (its last token changed), a token of the history edited, the oldest
    tokens cut, the history dropped (only the system prompt and a new message), a prompt
    that ends inside the previous turn, or no new message at all."""
    rng = random.Random(seed)
    prompt, action = list(SYSTEM), [rng.randrange(300, 400)]
    out = [(prompt, action)]
    for _ in range(turns - 1):
        history = prompt + action
        cut = rng.randrange(1, len(history)) if len(history) > 1 else 1  # keeps a token
        kind = rng.choice(
            ["extend", "extend", "retokenize", "edit", "cut", "drop", "short", "same"]
        )
        if kind == "retokenize":
            history = [*history[:-1], history[-1] + 1000]
        elif kind == "edit":
            i = rng.randrange(len(history))
            history = [*history[:i], history[i] + 1000, *history[i + 1 :]]
        elif kind == "cut":
            history = history[cut:] or history
        elif kind == "drop":
            history = list(SYSTEM)
        elif kind == "short":
            history = history[:cut]
        new = [] if kind in ("same", "short") else [rng.randrange(200, 300)]
        prompt, action = history + new, [rng.randrange(300, 400) for _ in range(rng.randrange(3))]
        out.append((prompt, action))
    return out


def native_window(turns: int, seed: int, window: int = 2) -> list[tuple[list[int], list[int]]]:
    """A native environment's history window (actors/prompts.py): the system prompt, the
    last `window` turns (each a user message and the reply as sampled, opened by the
    template's marker 100), then the current message. Its prompts extend the previous turn
    until the window is full, then slide: the oldest turn dropped, the rest kept whole."""
    rng = random.Random(seed)
    past: list[list[int]] = []  # each earlier turn's tokens: user message + reply
    out = []
    for _ in range(turns):
        user = [100, rng.randrange(200, 300), rng.randrange(200, 300)]
        prompt = [*SYSTEM, *(t for turn in past[-window:] for t in turn), *user]
        action = [rng.randrange(300, 400) for _ in range(rng.randrange(1, 3))]
        out.append((prompt, action))
        past.append(user + action)
    return out


HAND_MADE = {  # (prompt_ids, action_ids) per turn; the breaks are written beside each
    "retokenized": [
        ([1, 2], [7, 8]),
        ([1, 2, 7, 8, 3], [9]),  # extends
        ([1, 2, 7, 8, 3, 99, 4], [5]),  # the reply [9] came back as [99]: shares 5 of 6
        ([1, 2, 7, 8, 3, 99, 4, 5], []),  # extends the drifted prompt again
        ([1, 2, 7, 8, 3, 99, 4, 5], [6]),  # after an empty action, no new message: extends
    ],
    "edited": [
        ([1, 2], [3]),
        ([0, 2, 3, 4], [5]),  # the system prompt edited: shares 0 of 3
        ([0, 2, 3, 4], [5]),  # the history cut short: shares all 4 of its tokens, of 5
    ],
}
HAND_BREAKS = {  # (traj, step) -> (extends_previous, shared_tokens, previous_tokens)
    ("retokenized", 1): (True, 4, 4),
    ("retokenized", 2): (False, 5, 6),
    ("retokenized", 3): (True, 8, 8),
    ("retokenized", 4): (True, 8, 8),
    ("edited", 1): (False, 0, 3),
    ("edited", 2): (False, 4, 5),
}


def group_rows(
    group: str, conversations: dict[str, list[tuple[list[int], list[int]]]], run: str
) -> list[dict]:
    """Valid step rows of one group: each rollout's turns as given (a reward at the end)."""
    rows = []
    for traj, turns in conversations.items():
        states = [f"{traj}-s{t}" for t in range(len(turns))]
        rewards = [0.0] * (len(turns) - 1) + [1.0]
        for row, (prompt, action) in zip(
            rollout(group, traj, states, rewards, shard=f"sh-{group}", env="chat", version=0),
            turns,
            strict=True,
        ):
            row.update(
                {
                    C.RUN_ID: run,
                    C.PROMPT_IDS: prompt,
                    C.ACTION_IDS: action,
                    C.BEHAVIOR_LOGPROBS: [-0.5] * len(action),
                }
            )
            rows.append(row)
    return rows


GROUPS = {  # group -> (run, its rollouts' conversations); G = 2
    "g-hand": ("r1", HAND_MADE),
    "g-keep": ("r1", {"k0": keeps_history(6, 0), "k1": keeps_history(3, 1)}),
    "g-native": ("r2", {"n0": native_window(6, 2), "n1": native_window(4, 3)}),
    **{
        f"g-drift{i}": ("r2", {f"d{i}a": drifting(12, 10 + i), f"d{i}b": drifting(9, 20 + i)})
        for i in range(4)
    },
}


def build_store(root: Path) -> Store:
    """One shard per group."""
    store = Store(str(root))
    for group, (run, conversations) in GROUPS.items():
        table = pa.Table.from_pylist(group_rows(group, conversations, run), schema=C.STEPS_SCHEMA)
        store.write_shard(table, group_size=2)
    return store


# --- the reference: the prefix property, read literally --------------------------------
def brute_force() -> dict[tuple[str, int], tuple[bool | None, int | None, int | None]]:
    """(traj, step) -> (extends_previous, shared_tokens, previous_tokens) of every step."""
    out = {}
    for _, conversations in GROUPS.values():
        for traj, turns in conversations.items():
            for t, (prompt, _) in enumerate(turns):
                if t == 0:
                    out[(traj, t)] = (None, None, None)
                    continue
                previous = turns[t - 1][0] + turns[t - 1][1]
                shared = 0
                while shared < min(len(prompt), len(previous)) and (
                    prompt[shared] == previous[shared]
                ):
                    shared += 1
                out[(traj, t)] = (prompt[: len(previous)] == previous, shared, len(previous))
    return out


def kinds() -> dict[tuple[str, int], str | None]:
    """(traj, step) -> "extends", "slide" or "drift" (None on a first step), read literally:
    a slide is the previous prompt P with a span [a, b) removed, a < b < len(P), then the
    previous action, as a prefix of the prompt."""
    out: dict[tuple[str, int], str | None] = {}
    for _, conversations in GROUPS.values():
        for traj, turns in conversations.items():
            out[(traj, 0)] = None
            for t in range(1, len(turns)):
                prompt, (before, action) = turns[t][0], turns[t - 1]
                if prompt[: len(before) + len(action)] == before + action:
                    out[(traj, t)] = "extends"
                    continue
                kept = [
                    before[:a] + before[b:] + action
                    for b in range(1, len(before))
                    for a in range(b)
                ]
                slide = any(prompt[: len(k)] == k for k in kept)
                out[(traj, t)] = "slide" if slide else "drift"
    return out
