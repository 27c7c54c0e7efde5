"""The learner's data feed: committed shards → validated → advantages → batches of B groups.

The unit of consumption is a *group* (docs/design.md §3: a shard holds whole groups; the
advantage stage needs whole groups). The ledger (`learner/ledger.parquet`, committed
atomically after every update and copied into every checkpoint) records for each
consumed group the update that used it and whether it was trained on or dropped as
stale. A shard all of whose groups are in the ledger is never read again, so across
restarts each group, hence each shard, is trained on exactly once.

Staleness of a group = learner version − the group's oldest `policy_version` (a group
whose actor loaded a new version between turns spans several), measured when
the batch is formed. Groups more than `max_staleness` behind are dropped and recorded
(status `stale`), never silently.

The ledger's file metadata also tells actors what the learner can still use: its version
after the last recorded update, B and max_staleness (written at start and with every
update; actors/throttle.py waits on them instead of generating groups that would go stale).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from gagpo.schemas import columns as C
from gagpo.schemas import layout
from gagpo.schemas.errors import GagpoError, ValidationError
from gagpo.schemas.policy import staleness
from gagpo.schemas.validate import check_group_owners
from gagpo.storage.archive import archived_ledger, is_segment, step_files
from gagpo.storage.segments import segment_refused
from gagpo.storage.store import ShardRef, Store

TRAINED, STALE = "trained", "stale"
# Column names of the ledger table, one row per consumed group (schemas/columns.py).
UPDATE, STATUS, LEARNER_VERSION = C.LEDGER_UPDATE, C.LEDGER_STATUS, C.LEDGER_LEARNER_VERSION
SHARD_GROUPS = C.SHARD_GROUPS
LEDGER_SCHEMA = C.LEDGER_SCHEMA
# Columns of a training batch: one row per action (agent turn).
BATCH_COLUMNS = (
    C.SHARD_ID,
    C.GROUP_ID,
    C.TRAJ_ID,
    C.STEP,
    C.PROMPT_IDS,
    C.ACTION_IDS,
    C.BEHAVIOR_LOGPROBS,
    C.POLICY_VERSION,
    C.ADVANTAGE,
)

AdvantageFn = Callable[[pl.LazyFrame], pl.LazyFrame]


def pipeline_advantages(estimator) -> AdvantageFn:
    """The advantage stage of `gagpo.pipeline` with `estimator` (a pipeline config variant)."""
    from gagpo.pipeline.advantages import compute_advantages

    return lambda steps: compute_advantages(steps, estimator)


@dataclass(frozen=True)
class GroupRef:
    """One group waiting in the feed (or consumed, in a batch)."""

    run_id: str
    shard_id: str
    group_id: str
    policy_version: int
    shard_groups: int
    committed_at: float  # seconds since the epoch when its shard became visible
    source: str = ""  # the file it was read from, when not its shard (an archive segment)

    @property
    def frame(self) -> str:
        return self.source or self.shard_id


@dataclass
class Batch:
    steps: pl.DataFrame  # BATCH_COLUMNS, groups in feed order
    groups: list[GroupRef]  # trained on
    stale: list[GroupRef]  # dropped for staleness while this batch was formed


class Ledger:
    """Which groups were consumed, by which update; see the module docstring.

    Rows of compacted groups live in the archive (storage/archive.py); `commit` writes
    only the tail (`tail_table()`), the rows of groups still in the inbox."""

    def __init__(self, table: pa.Table | None = None, archived: pa.Table | None = None) -> None:
        self.rows: dict[str, dict] = {}
        self._archived: set[str] = set()  # group ids whose rows the archive holds
        self._per_shard: dict[str, int] = {}
        self._shard_size: dict[str, int] = {}
        for row in archived.to_pylist() if archived is not None else []:
            self._add(row)
            self._archived.add(row[C.GROUP_ID])
        for row in (table if table is not None else LEDGER_SCHEMA.empty_table()).to_pylist():
            if row[C.GROUP_ID] not in self._archived:  # a tail written before its compaction
                self._add(row)

    @classmethod
    def load(cls, store: Store) -> Ledger:
        """The store's ledger: the archive's rows and the learner's tail."""
        path = layout.ledger(store.root)
        tail = store.read_table(path) if store.exists(path) else None
        return cls(tail, archived_ledger(store))

    def _add(self, row: dict) -> None:
        if row[C.GROUP_ID] in self.rows:
            raise GagpoError(f"group {row[C.GROUP_ID]} consumed twice (ledger invariant)")
        self.rows[row[C.GROUP_ID]] = row
        shard = row[C.SHARD_ID]
        self._per_shard[shard] = self._per_shard.get(shard, 0) + 1
        self._shard_size[shard] = row[SHARD_GROUPS]

    def record(self, groups: list[GroupRef], status: str, update: int, version: int) -> None:
        for g in groups:
            self._add(
                {
                    C.RUN_ID: g.run_id,
                    C.SHARD_ID: g.shard_id,
                    C.GROUP_ID: g.group_id,
                    SHARD_GROUPS: g.shard_groups,
                    C.POLICY_VERSION: g.policy_version,
                    UPDATE: update,
                    LEARNER_VERSION: version,
                    STATUS: status,
                }
            )

    def archive(self, group_ids: set[str]) -> None:
        """Mark the rows of `group_ids` as held by the archive (a compaction committed them):
        the next commit leaves them out of the tail."""
        self._archived |= group_ids & self.rows.keys()

    def __contains__(self, group_id: str) -> bool:
        return group_id in self.rows

    def shard_done(self, shard_id: str) -> bool:
        return self._per_shard.get(shard_id, 0) >= self._shard_size.get(shard_id, 1 << 62)

    def truncated(self, update: int) -> Ledger:
        """The ledger as it stood after `update` (resume from a checkpoint of that update).
        Archived rows stay: a compaction archives only published updates."""
        tail = self.tail_table()
        return Ledger(tail.filter(pc.less_equal(tail[UPDATE], update)), self.archived_table())

    def table(self) -> pa.Table:
        """Every row, archived and tail, in the order they were recorded."""
        return pa.Table.from_pylist(list(self.rows.values()), schema=LEDGER_SCHEMA)

    def tail_table(self) -> pa.Table:
        """The tail: rows of groups the archive does not hold (learner/ledger.parquet)."""
        rows = [r for g, r in self.rows.items() if g not in self._archived]
        return pa.Table.from_pylist(rows, schema=LEDGER_SCHEMA)

    def archived_table(self) -> pa.Table:
        rows = [r for g, r in self.rows.items() if g in self._archived]
        return pa.Table.from_pylist(rows, schema=LEDGER_SCHEMA)

    def commit(self, store: Store, metadata: dict[bytes, bytes] | None = None) -> None:
        store.write_parquet(self.tail_table(), layout.ledger(store.root), metadata or {})


@dataclass
class FeedStats:
    shards_read: int = 0
    shards_rejected: int = 0  # quarantined (or, in replay, skipped) with a reason
    groups_stale: int = 0
    steps_stale: int = 0


class Feed:
    """Forms batches of `batch_groups` whole groups from the committed shards of `source`."""

    def __init__(
        self,
        store: Store,
        ledger: Ledger,
        advantage_fn: AdvantageFn,
        *,
        batch_groups: int,
        max_staleness: int | None,
        source: Store | None = None,
        follow: bool = True,
        poll_interval_s: float = 2.0,
        idle_timeout_s: float | None = None,
        on_advantages: Callable[[ShardRef, pl.DataFrame], None] | None = None,
        vocab_size: int | None = None,
        replay_order: list[str] | None = None,
    ) -> None:
        self.store, self.ledger, self.advantage_fn = store, ledger, advantage_fn
        self.source = source or store
        self.replay = source is not None and source is not store
        self.batch_groups, self.max_staleness = batch_groups, max_staleness
        self.follow, self.poll_interval_s, self.idle_timeout_s = (
            follow,
            poll_interval_s,
            idle_timeout_s,
        )
        self.on_advantages = on_advantages
        self.vocab_size = vocab_size  # token ids at or past it: the shard is quarantined
        self._claims: dict[str, str] = {}  # group_id → shard read first with it (see _owner)
        self.stats = FeedStats()
        self._seen: set[str] = set()  # shard paths listed before
        self._unread: deque[ShardRef] = deque()
        self._pending: deque[GroupRef] = deque()
        self._frames: dict[str, pl.DataFrame] = {}  # shard_id → its unconsumed rows
        self._left: dict[str, int] = {}  # shard_id → groups of it still pending
        self._stale: list[GroupRef] = []  # dropped since the last batch (reported with it)
        self._unrecorded: list[GroupRef] = []  # dropped, not yet recorded in the ledger
        self._bytes: dict[str, int] = {}  # shard_id → its file's size (compaction by size)
        self._listed = False  # the archive was looked at (once when following a store)
        # An exact replay: the groups to train, in this order (None: every group, as read).
        self._order = None if replay_order is None else {g: i for i, g in enumerate(replay_order)}
        self.stop_reason: str | None = None  # why next_batch last returned None
        # The learner's version: LATEST of the store whose lease it holds (learner/lease.py),
        # so a shard of a newer policy_version is from the future and is quarantined.
        self._version: int | None = None

    # --- ingestion ------------------------------------------------------------------
    def poll(self, version: int | None = None) -> bool:
        """List shards; read new ones (oldest first), dropping stale groups at `version`,
        until B fresh groups are pending or no shard is left unread. Returns whether
        anything moved: a shard listed or read, a group made pending or stale."""
        moved = False
        for ref in self._listing():
            if ref.path not in self._seen:
                self._seen.add(ref.path)
                if not self.ledger.shard_done(ref.shard_id):
                    self._unread.append(ref)
                    moved = True
        if version is not None:
            self._version = version  # no shard from a version after it (the feed's LATEST)
            moved |= bool(self._take_stale(version))
        # An exact replay reads every file first, then batches in the replayed run's order.
        while self._unread and (self._order is not None or len(self._pending) < self.batch_groups):
            self._ingest(self._unread.popleft())
            moved = True
            if version is not None:
                self._take_stale(version)
        if self._order is not None and moved:
            self._pending = deque(sorted(self._pending, key=lambda g: self._order[g.group_id]))
        return moved

    def _listing(self) -> list[ShardRef]:
        """The files to read (storage/archive.py): in a replay, the replayed store's archive
        segments (as refs named by segment id) and then its inbox. Following a store, its
        inbox, and on the first listing the segments holding groups no learner consumed
        (`gagpo compact --all` moved them): the ledger skips those it already holds."""
        if not self.replay and self._listed:
            return self.source.list_shards()
        self._listed = True
        files = step_files(self.source)
        if not self.replay:  # segments of consumed groups: nothing for this learner
            files = replace(files, segments=tuple(s for s in files.segments if not s.consumed))
        return files.refs(self.source)

    def _take_stale(self, version: int) -> list[GroupRef]:
        stale = self._drop_stale(version)
        self._stale += stale
        self._unrecorded += stale
        return stale

    def _ingest(self, ref: ShardRef) -> None:
        committed_at, size = _commit_info(self.source, ref.path)
        try:
            latest = None if self.replay else self._version
            table = self.source.read_shard(ref, vocab_size=self.vocab_size, latest=latest)
            if not is_segment(ref):  # a segment holds each group once by construction
                check_group_owners(table, ref.shard_id, self._owner)
            steps = pl.from_arrow(table)
            advantages = self.advantage_fn(steps.lazy().select(C.ADVANTAGE_INPUT_COLUMNS)).collect()
        except (ValidationError, pl.exceptions.PolarsError, pa.ArrowInvalid) as exc:
            self.stats.shards_rejected += 1
            if is_segment(ref):  # the archive is never quarantined, nor skipped: refused
                raise segment_refused(ref.path, str(exc)) from None
            if not self.replay:  # a replay source is read only: skip, counted
                self.store.quarantine(ref.path, str(exc))
            return
        except FileNotFoundError:  # quarantined or removed by someone else meanwhile
            return
        self.stats.shards_read += 1
        self._bytes[ref.shard_id] = size
        if self.on_advantages is not None:
            self.on_advantages(ref, advantages)
        rows = steps.join(
            advantages.select(C.TRAJ_ID, C.STEP, C.ADVANTAGE), on=[C.TRAJ_ID, C.STEP], how="left"
        ).select(BATCH_COLUMNS)
        # A group may span versions (loaded between turns): its staleness is its oldest step's.
        # Run and shard are the group's own: a segment holds groups of many shards.
        groups = (
            steps.group_by(C.GROUP_ID, maintain_order=True)
            .agg(
                pl.col(C.POLICY_VERSION).min(), pl.col(C.RUN_ID).first(), pl.col(C.SHARD_ID).first()
            )
            .with_columns(pl.len().over(C.SHARD_ID).alias("n"))
        )
        self._claims.update(dict.fromkeys(groups[C.GROUP_ID].to_list(), ref.shard_id))
        source = ref.shard_id if is_segment(ref) else ""
        fresh = [
            GroupRef(run, shard, gid, int(ver), int(n), committed_at, source)
            for gid, ver, run, shard, n in groups.iter_rows()
            if gid not in self.ledger and (self._order is None or gid in self._order)
        ]
        if not fresh:
            return
        keep = pl.Series([g.group_id for g in fresh])
        self._frames[ref.shard_id] = rows.filter(pl.col(C.GROUP_ID).is_in(keep.implode()))
        self._left[ref.shard_id] = len(fresh)
        self._pending.extend(fresh)

    def _owner(self, group_id: str) -> str | None:
        """The shard that holds `group_id` for this learner: the ledger's, else the shard
        read first with it. A later shard with the same group is quarantined, so the
        ledger never meets a group twice."""
        row = self.ledger.rows.get(group_id)
        return row[C.SHARD_ID] if row else self._claims.get(group_id)

    # --- batches --------------------------------------------------------------------
    def _drop_stale(self, version: int) -> list[GroupRef]:
        if self.max_staleness is None:
            return []
        bound = self.max_staleness
        stale = [g for g in self._pending if staleness(version, g.policy_version) > bound]
        if stale:
            self._pending = deque(
                g for g in self._pending if staleness(version, g.policy_version) <= bound
            )
            self.stats.groups_stale += len(stale)
            self.stats.steps_stale += self._release(stale).height
        return stale

    def _release(self, groups: list[GroupRef]) -> pl.DataFrame:
        """Remove `groups` from the in-memory frames and return their rows, in order."""
        parts = []
        for shard_id in dict.fromkeys(g.frame for g in groups):
            ids = [g.group_id for g in groups if g.frame == shard_id]
            frame = self._frames[shard_id]
            parts.append(frame.filter(pl.col(C.GROUP_ID).is_in(pl.Series(ids).implode())))
            self._left[shard_id] -= len(ids)
            if self._left[shard_id] == 0:
                del self._frames[shard_id], self._left[shard_id]
            else:
                self._frames[shard_id] = frame.filter(
                    ~pl.col(C.GROUP_ID).is_in(pl.Series(ids).implode())
                )
        return pl.concat(parts)

    def next_batch(self, version: int, update: int | None = None) -> Batch | None:
        """Block until B fresh groups are pending; None when the data ran out (the reason
        in `stop_reason`): in replay once every shard is read, otherwise after
        `idle_timeout_s` in which nothing moved. A backlog is drained without sleeping:
        the feed waits a poll interval only when every listed shard has been read.

        Before it waits, groups dropped as stale are recorded in the ledger under `update`
        (the number the batch will get), so that throttled actors see them leave the
        backlog; otherwise actors and learner would wait on each other."""
        self.stop_reason = None
        last_progress = time.monotonic()
        while True:
            if self.poll(version):
                last_progress = time.monotonic()
            if len(self._pending) >= self.batch_groups:
                break
            if not self.follow and not self._unread:
                if self._pending:
                    break  # replay: a last, smaller batch
                self.stop_reason = f"every shard of {self.source.url} read (replay)"
                return None
            idle = time.monotonic() - last_progress
            if self.idle_timeout_s is not None and idle >= self.idle_timeout_s:
                self.stop_reason = (
                    f"no new committed groups for {self.idle_timeout_s:g} s (idle-timeout); "
                    f"{len(self._unread)} shard(s) unread, {len(self._pending)} group(s) pending"
                )
                return None
            if update is not None and self._unrecorded:
                self._record([], update, version)
            time.sleep(self.poll_interval_s)
        taken = [self._pending.popleft() for _ in range(min(self.batch_groups, len(self._pending)))]
        stale, self._stale = self._stale, []
        return Batch(self._release(taken), taken, stale)

    def consumed_bytes(self) -> int:
        """Bytes of the shards this feed read whose every group is in the ledger."""
        return sum(b for sid, b in self._bytes.items() if self.ledger.shard_done(sid))

    def forget_bytes(self) -> None:
        """After a compaction: the consumed shards it moved no longer count."""
        self._bytes = {s: b for s, b in self._bytes.items() if not self.ledger.shard_done(s)}

    def settings(self, version: int) -> dict[bytes, bytes]:
        """Ledger metadata for the actors' throttle: the learner at `version`, B, S (none
        without a staleness bound: replay and supervised runs throttle nobody)."""
        if self.max_staleness is None or self.replay:
            return {}
        return {
            C.META_LEARNER_VERSION: str(version).encode(),
            C.META_BATCH_GROUPS: str(self.batch_groups).encode(),
            C.META_MAX_STALENESS: str(self.max_staleness).encode(),
        }

    def announce(self, version: int) -> None:
        """Write the ledger with the learner's settings at start, so actors throttle to
        this learner's B and max_staleness from its first update on."""
        if self.settings(version):
            self.ledger.commit(self.store, self.settings(version))

    def commit(self, batch: Batch | None, update: int, version: int) -> None:
        """Record a trained batch, formed at learner `version`, and the groups dropped as
        stale (also those dropped since the last batch, when `batch` is None at the end of
        a run) in the ledger; its metadata then names the version after the update."""
        self._record(batch.groups if batch else [], update, version)

    def _record(self, trained: list[GroupRef], update: int, version: int) -> None:
        stale, self._unrecorded = self._unrecorded, []
        if trained or stale:
            self.ledger.record(trained, TRAINED, update, version)
            self.ledger.record(stale, STALE, update, version)
            self.ledger.commit(self.store, self.settings(version + 1 if trained else version))


def _commit_info(store: Store, path: str) -> tuple[float, int]:
    """When a shard became visible (its modification time: a rename keeps the temp file's)
    and its size in bytes."""
    try:
        info = store.info(path)  # an outage is retried there, up to the store's bound
    except (OSError, ValueError):
        return time.time(), 0
    size = int(info.get("size") or 0)
    for key in ("mtime", "LastModified", "last_modified", "created"):
        value = info.get(key)
        if value is None:
            continue
        return (value.timestamp() if hasattr(value, "timestamp") else float(value)), size
    return time.time(), size
