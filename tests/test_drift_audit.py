"""The drift audit (issue 38): the `prompt_drift` view says, for every step, whether its
prompt begins with the previous step's prompt_ids + action_ids, and `gagpo view`'s group
page marks the steps where it does not. Both are checked against a brute-force reading of
the prefix property in Python, over conversations that keep their history, drift (a reply
re-tokenized), edit or cut it, and environments whose prompts never extend the previous turn."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import pytest

from gagpo.inspection import sql
from gagpo.inspection import sql_sources as src
from gagpo.inspection.view.data import StoreSession, group_view
from gagpo.schemas import columns as C
from gagpo.storage.archive import step_files
from gagpo.storage.compaction import compact
from gagpo.storage.store import Store
from tests.helpers.drift import GROUPS, HAND_BREAKS, brute_force, build_store

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
                expected[run][1] += reference[(traj, t)][0] is False
    assert {run: [r["turns"], r["breaks"]] for run, r in got.items()} == expected
    for row in got.values():
        assert row["break_rate"] == pytest.approx(row["breaks"] / row["turns"])

    group_of = {traj: group for group, (_, c) in GROUPS.items() for traj in c}
    breaks = sorted(
        (group_of[traj], traj, step, shared, previous)
        for (traj, step), (extends, shared, previous) in reference.items()
        if extends is False
    )
    got = [
        (r[C.GROUP_ID], r[C.TRAJ_ID], r[C.STEP], r["shared_tokens"], r["previous_tokens"])
        for r in sql.query_store(store, listed).to_pylist()
    ]
    assert got == breaks[:20]


# --- gagpo view's group page -----------------------------------------------------------
def test_the_group_page_marks_exactly_the_breaks_of_groups_with_history(store):
    reference = brute_force()
    session = StoreSession("drift", store.url)
    try:
        for group, (_, conversations) in GROUPS.items():
            page = group_view(session, group, "grpo", {})
            marked = {
                (r["traj_id"], s["step"])
                for r in page["rollouts"]
                for s in r["steps"]
                if s["prompt_break"]
            }
            verdicts = {k: v[0] for k, v in reference.items() if k[0] in conversations}
            history = any(verdicts.values())  # some prompt of the group extends its turn
            expected = {k for k, e in verdicts.items() if e is False} if history else set()
            assert marked == expected, group
            assert page["drift"] == {
                "tested": sum(len(c) - 1 for c in conversations.values()),
                "breaks": len(expected),
                "any_extends": history,
            }
            for r in page["rollouts"]:
                for s in r["steps"]:  # the numbers the mark's title gives
                    extends, shared, previous = reference[(r["traj_id"], s["step"])]
                    assert (s["extends_previous"], s["shared_tokens"], s["previous_tokens"]) == (
                        extends,
                        shared,
                        previous,
                    )
        native = group_view(session, "g-native", "grpo", {})
        assert native["drift"] == {"tested": 7, "breaks": 0, "any_extends": False}
        hand = group_view(session, "g-hand", "grpo", {})  # every turn of "edited" breaks
        assert hand["drift"] == {"tested": 6, "breaks": 3, "any_extends": True}
    finally:
        session.close()
