"""The store: layout, atomic commit, committed-only listing, validation and quarantine.

Each test runs on a local folder and on an S3-compatible server (moto) on loopback.
"""

from __future__ import annotations

import math
import os
import posixpath
import time

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from gagpo.schemas import columns as C
from gagpo.schemas.errors import GagpoError, ValidationError
from gagpo.storage.store import Store
from tests.helpers.steps import make_steps


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path) -> Store:
    if request.param == "local":
        return Store(str(tmp_path / "store"))
    endpoint = request.getfixturevalue("s3_endpoint")
    prefix = f"s3://gagpo/{tmp_path.name}"
    return Store(prefix, client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True)


def test_write_then_list_and_read_back(store: Store):
    table = make_steps(shard_id="a1")
    ref = store.write_shard(table, group_size=3)
    assert ref.path.endswith("shards/run=run1/a1.parquet")
    refs = store.list_shards()
    assert [(r.run_id, r.shard_id) for r in refs] == [("run1", "a1")]
    back = store.read_shard(refs[0])
    assert back.num_rows == table.num_rows
    assert back.schema.metadata[C.META_SCHEMA_VERSION] == C.STEPS_SCHEMA_VERSION.encode()
    assert back.select(list(C.STEPS_COLUMNS)).cast(C.STEPS_SCHEMA).equals(table)


def test_read_table_keeps_metadata_reads_columns_and_names_a_missing_one(store: Store):
    """Store.read_table decodes on the calling thread (schemas.store.parquet_table, not
    pq.read_table, whose clean-up can abort a process exiting right after it): the same
    table and metadata as pyarrow's own reader, only the asked columns, and a missing
    column raises as pq.read_table does."""
    table = make_steps(shard_id="a1")
    ref = store.write_shard(table, group_size=3)
    back = store.read_table(ref.path)
    expected = pq.read_table(pa.BufferReader(store.read_bytes(ref.path)))
    assert back.equals(expected) and back.schema.metadata == expected.schema.metadata
    assert back.schema.metadata[C.META_SCHEMA_VERSION] == C.STEPS_SCHEMA_VERSION.encode()
    assert store.read_table(ref.path, [C.GROUP_ID, C.STEP]).column_names == [C.GROUP_ID, C.STEP]
    with pytest.raises(pa.ArrowInvalid, match="no column 'nope'"):
        store.read_table(ref.path, [C.GROUP_ID, "nope"])
    with pytest.raises(FileNotFoundError):
        store.read_table(store.path("shards", "run=run1", "absent.parquet"))


def test_list_filters_by_run_and_ignores_temporaries(store: Store):
    store.write_shard(make_steps(run_id="a", shard_id="s1"), group_size=3)
    store.write_shard(make_steps(run_id="b", shard_id="s2"), group_size=3)
    # A leftover temporary (as a killed writer leaves behind) is never listed.
    store.fs.pipe_file(store.path("shards", "run=a", ".tmp-dead-s3.parquet"), b"PAR1 torn")
    assert [r.shard_id for r in store.list_shards()] == ["s1", "s2"]
    assert [r.shard_id for r in store.list_shards("b")] == ["s2"]


def test_writer_refuses_incomplete_group(store: Store):
    table = make_steps(shard_id="x")
    partial = table.filter(pc.not_equal(table.column(C.TRAJ_ID), "x-g0-r1"))
    with pytest.raises(ValidationError, match="group x-g0 has 2 rollouts"):
        store.write_shard(partial, group_size=3)
    assert store.list_shards() == []


def _commit_raw(store: Store, table: pa.Table, name: str, metadata: dict) -> str:
    path = store.shard_path("run1", name)
    store.write_parquet(table, path, metadata)
    return path


META = {C.META_SCHEMA_VERSION: b"1.0", C.META_GROUP_SIZE: b"3"}


@pytest.mark.parametrize(
    ("mutate", "metadata", "reason"),
    [
        (lambda t: t, {C.META_SCHEMA_VERSION: b"2.0"}, "unknown schema major version 2"),
        (lambda t: t.drop_columns([C.REWARD]), META, "missing column"),
        (
            lambda t: t.set_column(
                t.schema.get_field_index(C.BEHAVIOR_LOGPROBS),
                C.BEHAVIOR_LOGPROBS,
                pa.array([[-0.1]] * t.num_rows, pa.list_(pa.float32())),
            ),
            META,
            "action_ids and behavior_logprobs differ in length",
        ),
        (
            lambda t: t.set_column(
                t.schema.get_field_index(C.REWARD),
                C.REWARD,
                pa.array([math.nan] + [0.0] * (t.num_rows - 1), pa.float32()),
            ),
            META,
            "non-finite reward",
        ),
        (
            lambda t: t.filter(pc.not_equal(t.column(C.TRAJ_ID), "q-g1-r2")),
            META,
            "group q-g1 has 2 rollouts",
        ),
    ],
    ids=["major-version", "missing-column", "lengths", "nan-reward", "split-group"],
)
def test_bad_shards_are_quarantined_with_reason(store: Store, mutate, metadata, reason):
    good = store.write_shard(make_steps(shard_id="good"), group_size=3)
    bad_path = _commit_raw(store, mutate(make_steps(shard_id="q")), "q", metadata)
    refs = store.list_shards()
    assert len(refs) == 2
    loaded = [ref.shard_id for ref, _ in store.iter_valid_shards(refs)]
    assert loaded == ["good"]
    assert not store.fs.exists(bad_path)
    [record] = store.quarantined()
    assert reason in record["reason"]
    assert record["original_path"] == bad_path
    assert [r.shard_id for r in store.list_shards()] == ["good"]
    assert store.read_shard(good).num_rows > 0


def test_truncated_file_is_quarantined(store: Store):
    table = make_steps(shard_id="t")
    path = store.shard_path("run1", "t")
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    store.commit_bytes(path, sink.getvalue().to_pybytes()[:200])
    assert list(store.iter_valid_shards(store.list_shards())) == []
    assert "unreadable Parquet" in store.quarantined()[0]["reason"]


def test_latest_pointer(store: Store):
    assert store.policies.latest() is None
    store.policies.set_latest(3)
    assert store.policies.latest() == 3


def test_unwritable_store_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(GagpoError, match="cannot be written"):
        Store(str(blocker / "store")).ensure_writable()


def test_unknown_protocol_is_a_clear_error():
    with pytest.raises(GagpoError, match="cannot be opened"):
        Store("nosuchproto://bucket/x")


def test_listing_sees_shards_another_writer_added(store: Store):
    """Issue 14 case 2: a listing must not come from a cache filled by an earlier listing
    (s3fs caches directory listings by default). The writer here is another filesystem
    instance, as another process would be."""
    writer = Store(store.url, skip_instance_cache=True) if not store.is_local else Store(store.url)
    writer.write_shard(make_steps(shard_id="s1"), group_size=3)
    assert [r.shard_id for r in store.list_shards()] == ["s1"]
    assert [r.shard_id for r in store.list_shards("run1")] == ["s1"]
    writer.write_shard(make_steps(shard_id="s2"), group_size=3)
    writer.write_shard(make_steps(run_id="run2", shard_id="s3"), group_size=3)
    assert [r.shard_id for r in store.list_shards()] == ["s1", "s2", "s3"]
    assert [r.shard_id for r in store.list_shards("run1")] == ["s1", "s2"]
    assert store.exists(writer.shard_path("run2", "s3"))


def _age(path: str, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_stale_temporaries_are_removed_by_the_next_writer(tmp_path, monkeypatch):
    """Issue 14 case 8: `.tmp-…` files of killed commits older than the bound (1 h by
    default) go when the next writer commits into that folder; a fresh one, which a live
    writer may still rename, stays."""
    store = Store(str(tmp_path / "store"))
    store.write_shard(make_steps(shard_id="s1"), group_size=3)
    folder = posixpath.dirname(store.shard_path("run1", "s1"))
    old, fresh = (os.path.join(folder, f".tmp-{n}-s9.parquet") for n in ("old", "fresh"))
    for path in (old, fresh):
        with open(path, "wb") as handle:
            handle.write(b"PAR1 torn")
    _age(old, 3601)
    _age(fresh, 3000)
    # A killed actor's run folder, which no one writes into again.
    os.makedirs(store.path("shards", "run=dead"))
    dead = store.path("shards", "run=dead", ".tmp-x-s8.parquet")
    with open(dead, "wb") as handle:
        handle.write(b"PAR1 torn")
    _age(dead, 7200)
    Store(str(tmp_path / "store")).write_shard(make_steps(shard_id="s2"), group_size=3)
    assert not os.path.exists(old) and not os.path.exists(dead) and os.path.exists(fresh)
    assert [r.shard_id for r in store.list_shards()] == ["s1", "s2"]
    # The bound is configurable; staging folders of killed actors in policy/ go too.
    staging = store.path("policy", ".tmp-v0-dead")
    os.makedirs(staging)
    _age(staging, 120)
    monkeypatch.setenv("GAGPO_TEMP_MAX_AGE_S", "60")
    later = Store(str(tmp_path / "store"))
    later.commit_bytes(store.shard_path("run1", "s3"), b"x")
    assert not os.path.exists(fresh)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    later.policies.publish_base(str(model))
    assert not os.path.exists(staging) and later.policies.has(0)


def test_temporary_age_bound_must_be_positive(tmp_path, monkeypatch):
    monkeypatch.setenv("GAGPO_TEMP_MAX_AGE_S", "soon")
    with pytest.raises(GagpoError, match="GAGPO_TEMP_MAX_AGE_S='soon'; accepted: seconds > 0"):
        Store(str(tmp_path / "store"))
