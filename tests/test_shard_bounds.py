"""Shards that got through (issue 21, item 4): policy versions from the future or below
0, behaviour log-probs that are not log-probabilities. Each is quarantined with its
reason by the learner's feed, and never committed by the store's writer."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from gagpo.schemas import columns as C
from gagpo.schemas.errors import ValidationError
from gagpo.storage.store import Store
from tests.helpers.shards import META, commit_raw, drain, make_feed
from tests.helpers.steps import make_steps

G = 3


def with_logprob(table: pa.Table, value: float) -> pa.Table:
    """`table` with the second behaviour log-prob of its third row set to `value`."""
    values = table.column(C.BEHAVIOR_LOGPROBS).to_pylist()
    values[2] = [values[2][0], value, *values[2][2:]]
    i = table.schema.get_field_index(C.BEHAVIOR_LOGPROBS)
    return table.set_column(i, table.schema.field(i), pa.array(values, pa.list_(pa.float32())))


BAD = {
    "future-version": (
        make_steps(shard_id="h", policy_version=10**12),
        "policy_version 1000000000000 is newer than the store's LATEST (v0)",
    ),
    "negative-version": (
        make_steps(shard_id="h", policy_version=-7),
        "policy_version -7 is negative",
    ),
    "nan-logprob": (
        with_logprob(make_steps(shard_id="h"), float("nan")),
        "behavior_logprobs holds nan at row 2",
    ),
    "inf-logprob": (
        with_logprob(make_steps(shard_id="h"), float("inf")),
        "behavior_logprobs holds inf at row 2",
    ),
    "minus-inf-logprob": (
        with_logprob(make_steps(shard_id="h"), float("-inf")),
        "behavior_logprobs holds -inf",
    ),
    "huge-negative-logprob": (
        with_logprob(make_steps(shard_id="h"), -1e30),
        "behavior_logprobs holds -1.0000000150474662e+30",
    ),
    "positive-logprob": (
        with_logprob(make_steps(shard_id="h"), 0.5),
        "behavior_logprobs holds 0.5 at row 2",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_feed_quarantines_and_trains_the_rest(store_dir: Path, case: str):
    table, reason = BAD[case]
    store = Store(str(store_dir))
    store.write_shard(make_steps(shard_id="good"), group_size=G)
    commit_raw(store, table, META)
    feed = make_feed(store)
    assert drain(feed) == ["good-g0", "good-g1"]  # the learner is at version 0
    [record] = store.quarantined()
    assert record["reason"].startswith(reason), record["reason"]
    assert feed.stats.shards_rejected == 1


@pytest.mark.parametrize("case", [c for c in BAD if c != "future-version"])
def test_writer_never_commits_them(store_dir: Path, case: str):
    table, reason = BAD[case]
    store = Store(str(store_dir))
    with pytest.raises(ValidationError) as info:
        store.write_shard(table, group_size=G)
    assert str(info.value).startswith(reason)
    assert store.list_shards() == []


def test_versions_up_to_latest_pass_and_newer_ones_do_not(store_dir: Path):
    store = Store(str(store_dir))
    store.write_shard(make_steps(shard_id="a", policy_version=4), group_size=G)
    [ref] = store.list_shards()
    assert store.read_shard(ref, latest=4).num_rows > 0
    with pytest.raises(ValidationError, match="newer than the store's LATEST"):
        store.read_shard(ref, latest=3)


def test_log_probs_of_zero_and_rounding_hairs_pass(store_dir: Path):
    """Demonstrations record 0 (log 1); an engine's log-softmax may round a hair above."""
    store = Store(str(store_dir))
    store.write_shard(with_logprob(make_steps(shard_id="a"), 0.0), group_size=G)
    store.write_shard(with_logprob(make_steps(shard_id="b"), 1e-6), group_size=G)
    assert len(store.list_shards()) == 2
