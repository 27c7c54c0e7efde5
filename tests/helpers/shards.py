"""Shards as a hostile or buggy writer commits them, and the learner's feed drained."""

from __future__ import annotations

import pyarrow as pa

from gagpo.learner.feed import Feed, Ledger, pipeline_advantages
from gagpo.pipeline.config import GagpoConfig
from gagpo.schemas import columns as C
from gagpo.storage.store import Store

META = {C.META_SCHEMA_VERSION: C.STEPS_SCHEMA_VERSION.encode(), C.META_GROUP_SIZE: b"3"}


def commit_raw(store: Store, table: pa.Table, metadata: dict[bytes, bytes]) -> str:
    """Commit a shard the way a hostile or buggy writer would: no validation."""
    shard_id = table.column(C.SHARD_ID)[0].as_py() if table.num_rows else "empty"
    path = store.shard_path("run1", shard_id)
    store.write_parquet(table, path, metadata)
    return path


def make_feed(store: Store, **kw) -> Feed:
    """The learner's feed of `store`, read once (no following), two groups a batch."""
    kw = {"batch_groups": 2, "max_staleness": 4, "follow": False, **kw}
    return Feed(store, Ledger.load(store), pipeline_advantages(GagpoConfig()), **kw)


def drain(feed: Feed) -> list[str]:
    """Train-like consumption: every batch committed to the ledger; the group ids, in order."""
    out, update = [], 1
    while (batch := feed.next_batch(0)) is not None:
        out += [g.group_id for g in batch.groups]
        feed.commit(batch, update, 0)
        update += 1
    return out
