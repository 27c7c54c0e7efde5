"""The drift audit (issues 38, 47): the `prompt_drift` view says, for every step, whether its
prompt begins with the previous step's prompt_ids + action_ids, slides a history window
(the previous prompt with its oldest turn dropped), or drifts; `gagpo view`'s group page
marks the drift and counts the slides. Both are checked against a brute-force reading of
the rules in Python, over conversations that keep their history, drift (a reply
re-tokenized), edit or cut it, and a native environment's history window; and the one
definition of schemas/extends.py (the actor's, the learner's arrays, the view's SQL) is
held to one answer."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from gagpo.inspection import sql
from gagpo.inspection import sql_sources as src
from gagpo.inspection.view.data import StoreSession, group_view
from gagpo.schemas import columns as C
from gagpo.schemas import extends as rule
from gagpo.storage.archive import step_files
from gagpo.storage.compaction import compact
from gagpo.storage.store import Store
from tests.helpers.drift import GROUPS, HAND_BREAKS, brute_force, build_store, kinds

DOCS = Path(__file__).resolve().parents[1] / "docs" / "inspect.md"


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Store:
    return build_store(tmp_path_factory.mktemp("drift") / "store")


def audit(store: Store) -> dict[tuple[str, int], tuple]:
    table = sql.query_store(
        store,
        "SELECT traj_id, step, extends_previous, shared_tokens, previous_tokens, prompt_tokens "
        "FROM prompt_drift",
    )
    return {
        (r["traj_id"], r["step"]): (r["extends_previous"], r["shared_tokens"], r["previous_tokens"])
        for r in table.to_pylist()
    }


def test_the_cases_break_where_they_should():
    expected = brute_force()
    for key, value in HAND_BREAKS.items():
        assert expected[key] == value, key  # the reference reads the hand-made turns so
    breaks = [k for k, (extends, _, _) in expected.items() if extends is False]
    kept = [k for k, (extends, _, _) in expected.items() if extends is True]
    assert len(breaks) >= 20 and len(kept) >= 20  # both kinds, in numbers
    assert all(expected[(t, s)][0] for t in ("k0", "k1") for s in range(1, 3))


def test_prompt_drift_equals_the_brute_force_prefix_check(store):
    assert audit(store) == brute_force()


def test_prompt_drift_reads_the_archive_as_it_reads_the_inbox(tmp_path):
    store = build_store(tmp_path / "store")
    before = audit(store)
    compact(store, store.list_shards()[:4], None)  # segments, which DuckDB reads itself
    files = step_files(store)
    assert files.segments and files.shards  # the archive and the inbox both hold groups
    assert src.native_segments(store, files)
    assert audit(store) == before == brute_force()


def test_prompt_drift_columns_and_first_steps(store):
    table = sql.query_store(store, "SELECT * FROM prompt_drift ORDER BY traj_id, step")
    assert table.column_names == [
        C.RUN_ID,
        C.GROUP_ID,
        C.TRAJ_ID,
        C.STEP,
        C.ENV,
        C.POLICY_VERSION,
        "prompt_tokens",
        "previous_tokens",
        "extends_previous",
        "window_slide",
        "drift",
        "shared_tokens",
    ]
    rows = table.to_pylist()
    turns = {traj: t for _, c in GROUPS.values() for traj, t in c.items()}
    assert len(rows) == sum(len(t) for t in turns.values())  # one row per step
    for row in rows:
        assert row["prompt_tokens"] == len(turns[row[C.TRAJ_ID]][row[C.STEP]][0])
        if row[C.STEP] == 0:  # nothing before it: no verdict
            assert row["extends_previous"] is None and row["previous_tokens"] is None


def test_the_docs_query_counts_breaks_per_run(store):
    text = DOCS.read_text(encoding="utf-8")
    section = re.split(r"^### ", text, flags=re.M)
    (drift,) = [s for s in section if s.startswith("Prompt drift")]
    per_run, listed = re.findall(r"```sql\n(.*?)```", drift, flags=re.S)
    got = {r[C.RUN_ID]: r for r in sql.query_store(store, per_run).to_pylist()}
    expected: dict[str, list] = defaultdict(lambda: [0, 0])
    reference = brute_force()
    for run, conversations in GROUPS.values():
        for traj, turns in conversations.items():
            for t in range(1, len(turns)):
                expected[run][0] += 1
                expected[run][1] += kinds()[(traj, t)] == "drift"
    assert {run: [r["turns"], r["drifted"]] for run, r in got.items()} == expected
    for row in got.values():
        assert row["drift_rate"] == pytest.approx(row["drifted"] / row["turns"])
    slides: dict[str, int] = defaultdict(int)
    for (traj, _), found in kinds().items():
        run = next(run for run, c in GROUPS.values() if traj in c)
        slides[run] += found == "slide"
    assert {run: r["slides"] for run, r in got.items()} == slides

    group_of = {traj: group for group, (_, c) in GROUPS.items() for traj in c}
    breaks = sorted(
        (group_of[traj], traj, step, shared, previous)
        for (traj, step), (extends, shared, previous) in reference.items()
        if kinds()[(traj, step)] == "drift"
    )
    got = [
        (r[C.GROUP_ID], r[C.TRAJ_ID], r[C.STEP], r["shared_tokens"], r["previous_tokens"])
        for r in sql.query_store(store, listed).to_pylist()
    ]
    assert got == breaks[:20]


# --- gagpo view's group page -----------------------------------------------------------
def test_the_group_page_marks_exactly_the_drift_and_counts_the_slides(store):
    reference, found = brute_force(), kinds()
    session = StoreSession("drift", store.url)
    try:
        for group, (_, conversations) in GROUPS.items():
            page = group_view(session, group, "grpo", {})
            marked = {
                (r["traj_id"], s["step"])
                for r in page["rollouts"]
                for s in r["steps"]
                if s["drift"]
            }
            mine = {k: v for k, v in found.items() if k[0] in conversations}
            assert marked == {k for k, v in mine.items() if v == "drift"}, group
            assert page["drift"] == {
                "tested": sum(len(c) - 1 for c in conversations.values()),
                "drift": len(marked),
                "slides": sum(v == "slide" for v in mine.values()),
            }
            for r in page["rollouts"]:
                for s in r["steps"]:  # the numbers the mark's title gives
                    extends, shared, previous = reference[(r["traj_id"], s["step"])]
                    assert (s["extends_previous"], s["shared_tokens"], s["previous_tokens"]) == (
                        extends,
                        shared,
                        previous,
                    )
        native = group_view(session, "g-native", "grpo", {})  # window 2: slides from turn 3
        assert native["drift"] == {"tested": 8, "drift": 0, "slides": 4}
        hand = group_view(session, "g-hand", "grpo", {})  # every turn of "edited" drifts
        assert hand["drift"] == {"tested": 6, "drift": 3, "slides": 0}
    finally:
        session.close()


# --- one definition --------------------------------------------------------------------
def test_the_actor_the_learner_and_the_view_read_one_rule(store):
    """schemas/extends.py's function (the actor's count), its array form (the learner's
    segments) and its SQL (the view) give the literal reading's answer on every step."""
    reference = kinds()
    view = {
        (r[C.TRAJ_ID], r[C.STEP]): (
            None
            if r["extends_previous"] is None
            else "extends"
            if r["extends_previous"]
            else "slide"
            if r["window_slide"]
            else "drift"
        )
        for r in sql.query_store(
            store, "SELECT traj_id, step, extends_previous, window_slide FROM prompt_drift"
        ).to_pylist()
    }
    assert view == reference
    assert set(reference.values()) == {None, "extends", "slide", "drift"}
    rows = [  # sorted by the trajectory key, then step: as the learner reads them
        (group, traj, t, prompt, action)
        for group, (_, conversations) in sorted(GROUPS.items())
        for traj, turns in sorted(conversations.items())
        for t, (prompt, action) in enumerate(turns)
    ]
    same = rule.same_trajectory(
        np.array([r[0] for r in rows], dtype=object), np.array([r[1] for r in rows], dtype=object)
    )
    p_len = np.array([len(r[3]) for r in rows])
    n = p_len + np.array([len(r[4]) for r in rows])
    tokens = np.array([t for r in rows for t in (*r[3], *r[4])], dtype=np.int64)
    arrays = rule.extends_rows(same, tokens, p_len, n)
    for i, (_, traj, t, prompt, _) in enumerate(rows):
        expected = reference[(traj, t)]
        assert arrays[i] == (expected == "extends"), (traj, t)
        if t:
            before, action = rows[i - 1][3], rows[i - 1][4]
            assert rule.kind(prompt, before, action) == expected, (traj, t)


def test_the_trajectory_key_is_group_and_rollout():
    """Two groups whose rollouts share a traj_id are two trajectories, never one."""
    assert rule.TRAJECTORY_KEY == (C.GROUP_ID, C.TRAJ_ID)
    same = rule.same_trajectory(
        np.array(["g1", "g2"], dtype=object), np.array(["t", "t"], dtype=object)
    )
    assert same.tolist() == [False, False]
    out = rule.extends_rows(same, np.array([1, 2, 1, 2, 3]), np.array([1, 3]), np.array([2, 3]))
    assert out.tolist() == [False, False]
