"""One definition of "a prompt extends the previous step": the rule the actor's break count,
the `prompt_drift` view and the learner's turn merging all read.

A trajectory is the steps of one `(group_id, traj_id)` (`TRAJECTORY_KEY`), in `step` order.
Step t's prompt **extends** step t-1 when it begins with step t-1's `prompt_ids +
action_ids`, token for token: the learner can then encode both in one segment, and the
tokens the policy sampled are the tokens the next prompt holds.

A step that does not extend is one of two kinds:

- a **window slide**: the prompt is the previous prompt with one span dropped, the rest
  kept whole, followed by the previous action: `previous_prompt[:a] +
  previous_prompt[b:] + previous_action` begins it, for some a < b < len(previous_prompt)
  (`slides`). That is what a history window writes when it drops its oldest turn(s) (a
  native environment's `history_window`, or turns dropped to fit the context), and what
  an agent framework that trims its oldest messages writes; a window that dropped a turn
  identical to the one it added (a model that repeats itself) included. Nothing the
  policy saw was rewritten: the step only starts a new segment. A window that keeps no
  earlier turn (`history_window = 0`, or a current turn so long that every earlier one is
  dropped) keeps nothing of the previous prompt to recognise: its steps count as drift,
  as an agent that replaced its history with a new message does. Read on tokens, a
  conversation cut back to an earlier turn that got the same reply reads as a slide too.
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
    """Whether a prompt that does not extend the previous step is a window slide (module
    docstring). With s = the tokens it shares with the previous prompt P and A the previous
    action: some 1 <= e < len(P) has prompt[e : e+len(A)] == A and the k = max(1, e - s)
    tokens before e equal P's last k (then a = e - k, b = len(P) - k). False for a prompt
    that extends."""
    if extends(prompt, previous_prompt, previous_action):
        return False
    q, p, a = list(prompt), list(previous_prompt), list(previous_action)
    s = shared_prefix(q, p)
    for e in range(1, min(len(p), len(q) - len(a) + 1)):
        k = max(1, e - s)
        if q[e : e + len(a)] == a and q[e - k : e] == p[len(p) - k :]:
            return True
    return False


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


# -- the same rules in SQL (DuckDB), over columns `prompt`, `previous_prompt`,
# `previous_action` and `previous` (= previous_prompt || previous_action), with `shared` =
# the tokens `prompt` shares with `previous_prompt`. `lambda x: …` is DuckDB's lambda from 1.3 on.
EXTENDS_SQL = "(len(prompt) >= len(previous) AND prompt[1:len(previous)] = previous)"

SHARED_SQL = """coalesce(
    list_position(
        list_transform(range(1, least(len(prompt), len(previous_prompt)) + 1),
                       lambda i: prompt[i] != previous_prompt[i]),
        true) - 1,
    least(len(prompt), len(previous_prompt)))"""

# 1-based: the previous action at prompt[e+1 : e+len(A)], e (0-based) in [1, len(P)), and
# the k = greatest(1, e - shared) tokens before it equal to P's last k.
SLIDES_SQL = f"""(NOT {EXTENDS_SQL} AND coalesce(list_bool_or(list_transform(
    list_filter(range(1, least(len(previous_prompt), len(prompt) - len(previous_action) + 1)),
                lambda e: prompt[e + 1 : e + len(previous_action)] = previous_action),
    lambda e: prompt[e - greatest(1, e - shared) + 1 : e]
              = previous_prompt[len(previous_prompt) - greatest(1, e - shared) + 1
                                : len(previous_prompt)])), false))"""
