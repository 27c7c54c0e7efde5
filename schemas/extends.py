"""One definition of "a prompt extends the previous step": the rule the actor's break count,
the `prompt_drift` view and the learner's turn merging all read.

A trajectory is the steps of one `(group_id, traj_id)` (`TRAJECTORY_KEY`), in `step` order.
Step t's prompt **extends** step t-1 when it begins with step t-1's `prompt_ids +
action_ids`, token for token: the learner can then encode both in one segment, and the
tokens the policy sampled are the tokens the next prompt holds.

A step that does not extend is one of two kinds:

- a **window slide**: the prompt is the previous prompt with one span removed right after
  what the two share, the rest of the previous prompt kept whole and in place (`slides`).
  That is what a history window that drops its oldest turn(s) writes (a native
  environment's `history_window`, or turns dropped to fit the context), and what an
  agent framework that trims its oldest messages writes. Nothing the policy saw was
  rewritten: the step only starts a new segment.
  A window that keeps no earlier turn (`history_window = 0`, or a current turn so long
  that every earlier one is dropped) keeps nothing of the previous prompt to recognise:
  its steps count as drift, as an agent that replaced its history with a new message.
- **drift**: anything else. The reply did not survive the round trip through text and the
  chat template, a template rendered earlier turns differently (a reasoning template
  stripping old thoughts), or an agent edited its history.

Each rule is written here as a function over token lists (the actor), over the flat
arrays of a sorted table (the learner), and as the SQL text the view runs (DuckDB lists,
1-based, inclusive slices); tests/test_drift_audit.py holds the three to one answer.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gagpo.schemas import columns as C

TRAJECTORY_KEY = (C.GROUP_ID, C.TRAJ_ID)


def extends(
    prompt: Sequence[int], previous_prompt: Sequence[int], previous_action: Sequence[int]
) -> bool:
    """Whether `prompt` begins with `previous_prompt + previous_action`."""
    n, m = len(previous_prompt), len(previous_action)
    return (
        len(prompt) >= n + m
        and list(prompt[:n]) == list(previous_prompt)
        and list(prompt[n : n + m]) == list(previous_action)
    )


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` have in common."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def slides(
    prompt: Sequence[int], previous_prompt: Sequence[int], previous_action: Sequence[int]
) -> bool:
    """Whether a prompt that does not extend the previous step is a window slide: with
    s = the tokens it shares with the previous prompt, some s < b < len(previous_prompt)
    has prompt[s : s + len - b] == previous_prompt[b:] (the span [s, b) removed, the rest
    kept whole). False for a prompt that extends."""
    if extends(prompt, previous_prompt, previous_action):
        return False
    p, s = list(previous_prompt), shared_prefix(prompt, previous_prompt)
    if s >= len(prompt):
        return False
    first = prompt[s]
    return any(
        p[b] == first and list(prompt[s : s + len(p) - b]) == p[b:] for b in range(s + 1, len(p))
    )


def kind(
    prompt: Sequence[int], previous_prompt: Sequence[int], previous_action: Sequence[int]
) -> str:
    """ "extends", "slide" or "drift" (module docstring)."""
    if extends(prompt, previous_prompt, previous_action):
        return "extends"
    return "slide" if slides(prompt, previous_prompt, previous_action) else "drift"


def same_trajectory(group_ids: np.ndarray, traj_ids: np.ndarray) -> np.ndarray:
    """[rows] of a table sorted by TRAJECTORY_KEY then step: whether each row is the next
    step of the previous row's trajectory (both key columns equal; False for row 0)."""
    same = np.zeros(len(traj_ids), dtype=bool)
    if len(traj_ids) > 1:
        same[1:] = (group_ids[1:] == group_ids[:-1]) & (traj_ids[1:] == traj_ids[:-1])
    return same


def extends_rows(
    same: np.ndarray, tokens: np.ndarray, prompt_len: np.ndarray, n: np.ndarray
) -> np.ndarray:
    """[rows] `extends` over a sorted table's flat token values: row i holds `n[i]` tokens
    from offset sum(n[:i]) in `tokens`, its prompt the first `prompt_len[i]`; `same` from
    `same_trajectory`. Row i extends when its prompt begins with row i-1's tokens."""
    starts = np.cumsum(n) - n
    cand = np.flatnonzero(same & (prompt_len >= np.roll(n, 1)))  # long enough to hold it
    m = n[cand - 1]  # tokens to compare, per candidate
    owner = np.repeat(np.arange(len(cand)), m)
    within = np.arange(int(m.sum())) - np.repeat(np.cumsum(m) - m, m)
    differs = (
        tokens[np.repeat(starts[cand - 1], m) + within]
        != tokens[np.repeat(starts[cand], m) + within]
    )
    out = np.zeros(len(n), dtype=bool)
    out[cand] = np.bincount(owner, weights=differs, minlength=len(cand)) == 0
    return out


# -- the same rules in SQL (DuckDB), over columns `prompt`, `previous_prompt` and
# `previous` (= previous_prompt || previous_action), with `shared` = the tokens `prompt`
# shares with `previous_prompt`. `lambda x: …` is DuckDB's lambda from 1.3 on.
EXTENDS_SQL = "(len(prompt) >= len(previous) AND prompt[1:len(previous)] = previous)"

SHARED_SQL = """coalesce(
    list_position(
        list_transform(range(1, least(len(prompt), len(previous_prompt)) + 1),
                       lambda i: prompt[i] != previous_prompt[i]),
        true) - 1,
    least(len(prompt), len(previous_prompt)))"""

# 1-based: the kept rest previous_prompt[b+1:] (0-based b, s < b < len) must sit at
# prompt[s+1 : s + len - b]; candidates are filtered on their first token first.
SLIDES_SQL = f"""(NOT {EXTENDS_SQL} AND shared < len(prompt) AND coalesce(list_bool_or(list_transform(
    list_filter(range(shared + 1, len(previous_prompt)),
                lambda b: previous_prompt[b + 1] = prompt[shared + 1]),
    lambda b: prompt[shared + 1 : shared + len(previous_prompt) - b]
              = previous_prompt[b + 1 : len(previous_prompt)])), false))"""
