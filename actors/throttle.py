"""Backpressure: an actor waits instead of generating groups the learner would drop as stale.

The store is the only channel (docs/design.md §1, §7). Before each group the actor reads

    N  the backlog: committed groups not yet in the learner's ledger (shard listing minus
       `learner/ledger.parquet`, and the archive's groups no learner consumed: `gagpo
       compact --all` moves them into segments), plus the groups it holds itself, not yet
       committed;
    V  the learner's version after its last recorded update, B its batch size and S its
       max_staleness: the ledger's file metadata (the learner writes it when it starts and
       with every update; before that, a small default bound below).

The learner takes groups oldest first, B per update, and drops a group whose version is
more than S behind the learner's when its batch is formed. The batch in flight (formed,
not yet in the ledger) is part of N and is formed at V, so a new group made with policy
version p lands at position N, in the batch formed at version V + ⌊N/B⌋, and is trained iff

    V + ⌊N/B⌋ − p ≤ S   ⇔   N < (S − (V − p) + 1) · B.

`room` is how many more groups pass that test. The actor generates while room > 0: the
backlog then reaches (S + 1)·B ≥ B with the newest policy, so the learner always finds a
full batch when actors are fast; with S = 0 generation and training take turns, as they must.

Drops stay possible and are counted by the learner: actors started with an older policy,
a restarted learner, and racing actors (each checks before its own group and cannot see
the others' groups in flight, so A actors may overshoot by up to A − 1 groups).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from gagpo.schemas import columns as C
from gagpo.schemas import layout
from gagpo.schemas.errors import GagpoError
from gagpo.schemas.policy import staleness
from gagpo.storage.archive import (
    Segment,
    ledger_part_path,
    read_manifest,
    segment_path,
)
from gagpo.storage.segments import file_groups
from gagpo.storage.store import ShardRef, Store

# Until a learner has written its settings into the ledger: a backlog of at most 4 groups.
# A learner with B ≥ 2 and max_staleness ≥ 1 trains them all, any learner finds its first
# groups waiting, and actors started long before it do not fill the store with stale ones.
DEFAULT_BATCH_GROUPS = 4
DEFAULT_MAX_STALENESS = 0
POLL_S = 0.5


def room(
    backlog: int,
    *,
    learner_version: int,
    policy_version: int,
    batch_groups: int,
    max_staleness: int,
) -> int:
    """How many groups made with `policy_version` can still join a backlog of `backlog`
    groups and be trained within `max_staleness` (see the module docstring)."""
    lag = staleness(learner_version, policy_version)
    return max(0, (max_staleness - lag + 1) * batch_groups - backlog)


@dataclass(frozen=True)
class Backlog:
    """What the store says about the learner's queue."""

    groups: int  # committed, not in the ledger
    learner_version: int
    batch_groups: int
    max_staleness: int
    learner_seen: bool  # a learner has written its settings


class Throttle:
    """Reads the backlog from `store`; remembers the group count of each shard it read."""

    def __init__(self, store: Store, poll_s: float = POLL_S) -> None:
        self.store, self.poll_s = store, poll_s
        self._shard_groups: dict[str, int] = {}  # shard path → groups it holds (immutable)
        self._segment_groups: dict[str, set[str]] = {}  # segment id → its unconsumed groups
        self.seconds_waited = 0.0

    def backlog(self) -> Backlog:
        consumed, total, meta, recorded = self._ledger()
        groups = self._archived_unconsumed(recorded)
        for ref in self.store.list_shards():
            size = total.get(ref.shard_id)
            if size is None:
                size = self._groups_in(ref)
            groups += max(0, size - consumed.get(ref.shard_id, 0))
        latest = self.store.policies.latest() or 0

        def setting(key: bytes, default: int) -> int:
            return int(meta[key]) if key in meta else default

        return Backlog(
            groups=groups,
            learner_version=max(latest, setting(C.META_LEARNER_VERSION, latest)),
            batch_groups=setting(C.META_BATCH_GROUPS, DEFAULT_BATCH_GROUPS),
            max_staleness=setting(C.META_MAX_STALENESS, DEFAULT_MAX_STALENESS),
            learner_seen=C.META_BATCH_GROUPS in meta,
        )

    def room(self, policy_version: int, held: int = 0) -> int:
        """Groups the actor may still generate with `policy_version`, holding `held`
        uncommitted groups of its own."""
        b = self.backlog()
        return room(
            b.groups + held,
            learner_version=b.learner_version,
            policy_version=policy_version,
            batch_groups=b.batch_groups,
            max_staleness=b.max_staleness,
        )

    def pause(self) -> None:
        """Wait one poll interval (counted in `seconds_waited`)."""
        t0 = time.perf_counter()
        time.sleep(self.poll_s)
        self.seconds_waited += time.perf_counter() - t0

    def _ledger(self) -> tuple[dict[str, int], dict[str, int], dict[bytes, bytes], set[str]]:
        """Groups consumed per shard, each consumed shard's size, the ledger metadata, and
        the group ids the tail records."""
        path = layout.ledger(self.store.root)
        try:
            table = self.store.read_table(path, [C.SHARD_ID, C.SHARD_GROUPS, C.GROUP_ID])
        except FileNotFoundError:
            return {}, {}, {}, set()
        shards = table[C.SHARD_ID].combine_chunks()
        counts = pc.value_counts(shards)
        consumed = dict(
            zip(counts.field("values").to_pylist(), counts.field("counts").to_pylist(), strict=True)
        )
        total = dict(zip(shards.to_pylist(), table[C.SHARD_GROUPS].to_pylist(), strict=True))
        recorded = set(table[C.GROUP_ID].to_pylist())
        return consumed, total, dict(table.schema.metadata or {}), recorded

    def _archived_unconsumed(self, recorded: set[str]) -> int:
        """Groups the archive holds that no learner consumed (`gagpo compact --all` moves
        them out of the inbox): those of segments the manifest does not mark consumed,
        less the ones with a ledger row (the segment's ledger part, or the tail a learner
        wrote since it read them). Segments never change under their id, so each is read
        once (its group_id column) and remembered."""
        manifest = read_manifest(self.store)
        waiting = 0
        for segment in manifest.segments if manifest else ():
            if not segment.consumed:
                waiting += len(self._unconsumed_in(segment) - recorded)
        return waiting

    def _unconsumed_in(self, segment: Segment) -> set[str]:
        """The groups of `segment` its own ledger part does not record."""
        if segment.id not in self._segment_groups:
            groups = file_groups(self.store, segment_path(self.store, segment.id))
            if segment.min_update is not None:  # some of its groups were consumed
                part = self.store.read_table(ledger_part_path(self.store, segment.id), [C.GROUP_ID])
                groups -= set(part[C.GROUP_ID].to_pylist())
            self._segment_groups[segment.id] = groups
        return self._segment_groups[segment.id]

    def _groups_in(self, ref: ShardRef) -> int:
        if ref.path not in self._shard_groups:
            try:
                ids = self.store.read_table(ref.path, [C.GROUP_ID])[C.GROUP_ID]
            except (OSError, ValueError, pa.ArrowException, GagpoError):
                return 0  # quarantined meanwhile, unreadable, a link: the learner will not use it
            self._shard_groups[ref.path] = len(pc.unique(ids))
        return self._shard_groups[ref.path]
