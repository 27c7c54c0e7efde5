"""Hostile shards (issue 14, case 3) are quarantined with a reason by every reader: the
store's reader, the learner's feed and `gagpo advantages --store`. Never a crash, never
a wedged learner: each case below crashed one of them before."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from gagpo.learner.feed import Ledger
from gagpo.pipeline.config import GagpoConfig
from gagpo.pipeline.recompute import recompute_store
from gagpo.schemas import columns as C
from gagpo.schemas.errors import GagpoError
from gagpo.storage.store import Store
from tests.helpers.learner import VOCAB
from tests.helpers.shards import META, commit_raw, drain, make_feed
from tests.helpers.steps import make_steps

G = 3
NO_GROUP_SIZE = {C.META_SCHEMA_VERSION: C.STEPS_SCHEMA_VERSION.encode()}


def with_token(table: pa.Table, column: str, token: int) -> pa.Table:
    """`table` with the first row's token list of `column` holding `token`."""
    values = table.column(column).to_pylist()
    values[0] = [token, *values[0][1:]]
    i = table.schema.get_field_index(column)
    return table.set_column(i, table.schema.field(i), pa.array(values, pa.list_(pa.int32())))


# (shard id, table, metadata, reason) of each hostile single shard; the ids sort after "good".
HOSTILE = {
    "group-size-word": (
        lambda: make_steps(shard_id="h1"),
        {**META, C.META_GROUP_SIZE: b"four"},
        "gagpo.group_size is b'four'; accepted: a positive integer",
    ),
    "group-size-zero": (
        lambda: make_steps(shard_id="h1"),
        {**META, C.META_GROUP_SIZE: b"0"},
        "accepted: a positive integer",
    ),
    "schema-version-bytes": (
        lambda: make_steps(shard_id="h1"),
        {**META, C.META_SCHEMA_VERSION: b"\xff\xfe"},
        "malformed schema version",
    ),
    "zero-rows": (
        lambda: make_steps(shard_id="h1").slice(0, 0),
        META,
        "the shard holds no rows",
    ),
    "negative-action-id": (
        lambda: with_token(make_steps(shard_id="h1"), C.ACTION_IDS, -7),
        META,
        "column action_ids holds token id -7; accepted: ids >= 0",
    ),
    "negative-prompt-id": (
        lambda: with_token(make_steps(shard_id="h1"), C.PROMPT_IDS, -1),
        META,
        "column prompt_ids holds token id -1",
    ),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_store_reader_quarantines_hostile_shard(store_dir: Path, case: str):
    make, metadata, reason = HOSTILE[case]
    store = Store(str(store_dir))
    store.write_shard(make_steps(shard_id="good"), group_size=G)
    bad = commit_raw(store, make(), metadata)
    read = [ref.shard_id for ref, _ in store.iter_valid_shards(store.list_shards())]
    assert read == ["good"]
    [record] = store.quarantined()
    assert record["original_path"] == bad and reason in record["reason"]
    assert not store.fs.exists(bad)


@pytest.mark.parametrize("case", [*HOSTILE, "id-past-vocabulary"])
def test_learner_feed_quarantines_hostile_shard(store_dir: Path, case: str):
    if case == "id-past-vocabulary":  # the learner's IndexError in the embedding
        make, metadata, reason = (
            lambda: with_token(make_steps(shard_id="h1"), C.PROMPT_IDS, VOCAB),
            META,
            f"column prompt_ids holds token id {VOCAB}; accepted: ids below {VOCAB}",
        )
    else:
        make, metadata, reason = HOSTILE[case]
    store = Store(str(store_dir))
    store.write_shard(make_steps(shard_id="good"), group_size=G)
    commit_raw(store, make(), metadata)
    feed = make_feed(store, vocab_size=VOCAB)
    assert drain(feed) == ["good-g0", "good-g1"]
    assert feed.stats.shards_rejected == 1
    [record] = store.quarantined()
    assert reason in record["reason"]


def test_token_ids_within_the_vocabulary_pass(store_dir: Path):
    store = Store(str(store_dir))
    store.write_shard(with_token(make_steps(shard_id="a"), C.PROMPT_IDS, VOCAB - 1), group_size=G)
    assert drain(make_feed(store, vocab_size=VOCAB)) == ["a-g0", "a-g1"]
    assert store.quarantined() == []


def renamed(table: pa.Table, shard_id: str) -> pa.Table:
    i = table.schema.get_field_index(C.SHARD_ID)
    return table.set_column(
        i, table.schema.field(i), pa.array([shard_id] * table.num_rows, pa.string())
    )


def split_group(store: Store) -> None:
    """Group x-g0 with its rollouts over shards a (r0) and b (r1, r2), no group size in
    the metadata, and an unrelated whole group in b too."""
    whole = make_steps(shard_id="x", groups=1)
    first = whole.filter(pc.equal(whole.column(C.TRAJ_ID), "x-g0-r0"))
    second = whole.filter(pc.not_equal(whole.column(C.TRAJ_ID), "x-g0-r0"))
    other = make_steps(shard_id="y", groups=1)
    commit_raw(store, renamed(first, "a"), NO_GROUP_SIZE)
    commit_raw(store, renamed(pa.concat_tables([second, other]), "b"), NO_GROUP_SIZE)


def test_split_group_without_group_size_is_never_trained(store_dir: Path):
    """Issue 21: the first half of a split group was trained as a group of one rollout
    when the metadata had no group size. G is recorded per shard: without it, a shard
    cannot show its groups whole, and both halves are quarantined."""
    store = Store(str(store_dir))
    split_group(store)
    assert drain(make_feed(store)) == []
    reasons = [r["reason"] for r in store.quarantined()]
    assert len(reasons) == 2 and all(
        r.startswith("no group size in file metadata") for r in reasons
    )
    with pytest.raises(GagpoError, match="no committed shard"):  # both halves are gone
        recompute_store(str(store_dir), None, GagpoConfig())


def repeated_group(store: Store) -> None:
    """Shard b is a copy of shard a's groups (same group ids) under another shard id."""
    store.write_shard(make_steps(shard_id="a"), group_size=G)
    commit_raw(store, renamed(make_steps(shard_id="a"), "b"), META)


@pytest.mark.parametrize("make", [repeated_group], ids=["repeated"])
def test_feed_quarantines_the_later_copy_and_keeps_the_ledger_consistent(store_dir, make):
    store = Store(str(store_dir))
    make(store)
    feed = make_feed(store)
    trained = drain(feed)  # formerly: "consumed twice (ledger invariant)", on every restart
    assert len(trained) == len(set(trained))
    [record] = store.quarantined()
    assert record["original_path"].endswith("/b.parquet")
    assert "is already in shard a" in record["reason"]
    ledger = Ledger.load(store)
    assert sorted(ledger.rows) == sorted(trained)
    assert {row[C.SHARD_ID] for row in ledger.rows.values()} == {"a"}
    # A restart reads the ledger back and trains nothing twice; a late copy of a consumed
    # group (committed after the restart) is quarantined against the ledger.
    commit_raw(store, renamed(make_steps(shard_id="a"), "c"), META)
    retrained = drain(make_feed(store))
    assert not set(retrained) & set(trained)
    if make is repeated_group:
        assert retrained == [] and len(store.quarantined()) == 2


@pytest.mark.parametrize("make", [repeated_group], ids=["repeated"])
def test_recompute_store_applies_the_same_rules(store_dir: Path, make):
    store = Store(str(store_dir))
    make(store)
    summary = recompute_store(str(store_dir), None, GagpoConfig())
    assert summary.shards == 1
    [(path, reason)] = summary.quarantined
    assert path.endswith("/b.parquet") and "is already in shard a" in reason
    written = store.glob(store.path("advantages", "*", "*.parquet"))
    assert [Path(p).name for p in written] == ["a.parquet"]


@pytest.mark.parametrize("case", list(HOSTILE))
def test_recompute_store_quarantines_hostile_shard(store_dir: Path, case: str):
    make, metadata, reason = HOSTILE[case]
    store = Store(str(store_dir))
    store.write_shard(make_steps(shard_id="good"), group_size=G)
    commit_raw(store, make(), metadata)
    summary = recompute_store(str(store_dir), None, GagpoConfig())
    assert summary.shards == 1
    [(_, why)] = summary.quarantined
    assert reason in why


def test_learner_trains_past_hostile_shards(store_dir: Path):
    """The learner end to end: hostile shards of every kind beside good ones; it trains on
    the good groups, each once, and quarantines the rest with their reasons."""
    from gagpo.learner.config import LearnerConfig
    from gagpo.learner.train import train
    from tests.helpers.learner import shard_table, tiny_model_dir, write_shards

    store = Store(str(store_dir))
    write_shards(store, 2)  # s000, s001: 2 groups each, ids within the tiny model's vocabulary
    # read first (ids sort before s…), and a copy of s000 read between s000 and s001
    commit_raw(store, with_token(shard_table("h1"), C.ACTION_IDS, VOCAB + 5), META)
    commit_raw(store, shard_table("h2"), {**META, C.META_GROUP_SIZE: b"four"})
    commit_raw(store, shard_table("h3").slice(0, 0), META)
    commit_raw(store, renamed(shard_table("s000"), "s000b"), META)
    cfg = LearnerConfig(
        store=str(store_dir),
        policy=str(tiny_model_dir()),
        batch_groups=2,
        updates=2,
        idle_timeout_s=0.5,
        poll_interval_s=0.05,
    )
    summary = train(cfg)
    assert summary.updates == 2 and summary.rejected_shards == 4
    reasons = sorted(r["reason"].split(";")[0] for r in store.quarantined())
    assert reasons == [
        f"column action_ids holds token id {VOCAB + 5}",
        "group s000-g0 is already in shard s000 (a group split over two shards, or a copy)",
        "metadata gagpo.group_size is b'four'",
        "the shard holds no rows",
    ]
    assert sorted(Ledger.load(store).rows) == ["s000-g0", "s000-g1", "s001-g0", "s001-g1"]
