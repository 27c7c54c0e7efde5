"""Who compacts, and when: the learner in the background, or `gagpo compact` (storage/compaction.py).

Only the holder of the store's lease writes the archive. The learner holds it already:
after a publication, when `compaction.every_updates` updates passed since its last
compaction or the consumed shards in the inbox hold `compaction.min_mib`, it hands the
shards whose every group is in the ledger of a *published* update (so a `--resume` never
has to forget an archived row) to a background thread, and takes the result at a later
update: the archived groups leave the tail ledger at its next commit. The update loop
never waits for a compaction, except at the end of the run.

`gagpo compact --store S` takes the lease itself, so it never races a learner or another
compactor. By default it moves the shards a learner consumed (the ledger's, up to LATEST's
update); `--all` moves every shard, for stores no follow-mode learner will read again
(actor-only stores, demonstrations, finished runs): replays and every reader read the
archive, a follow-mode learner reads only the inbox.
"""

from __future__ import annotations

import functools
import re
import sys
import time

import click
import pyarrow as pa
import pyarrow.compute as pc

from gagpo.learner.config import CompactionSettings
from gagpo.schemas import columns as C
from gagpo.schemas.cli import OneLineCommand, run_cli, store_option
from gagpo.schemas.cli_models import ModelOptions
from gagpo.schemas.config import RUN_ID_PATTERN
from gagpo.schemas.errors import GagpoError
from gagpo.storage.archive import read_ledger, tail_ledger_path
from gagpo.storage.background import Background
from gagpo.storage.compaction import CompactionResult, compact
from gagpo.storage.store import ShardRef, Store


def consumed_shards(
    refs: list[ShardRef], ledger: pa.Table, up_to_update: int | None
) -> tuple[list[ShardRef], pa.Table]:
    """The inbox shards every group of which has a ledger row of an update ≤ `up_to_update`
    (None: any), and those rows."""
    if up_to_update is not None:
        ledger = ledger.filter(pc.less_equal(ledger[C.LEDGER_UPDATE], up_to_update))
    counts = pc.value_counts(ledger[C.SHARD_ID]) if ledger.num_rows else None
    done: dict[str, int] = {}
    if counts is not None:
        done = dict(
            zip(counts.field("values").to_pylist(), counts.field("counts").to_pylist(), strict=True)
        )
    size = dict(
        zip(ledger[C.SHARD_ID].to_pylist(), ledger[C.SHARD_GROUPS].to_pylist(), strict=True)
    )
    chosen = [r for r in refs if r.shard_id in done and done[r.shard_id] >= size[r.shard_id]]
    ids = pa.array(sorted({r.shard_id for r in chosen}), pa.string())
    return chosen, ledger.filter(pc.is_in(ledger[C.SHARD_ID], value_set=ids))


class Compactor:
    """The learner's background compaction (see the module docstring): one at a time, in
    a daemon thread (storage/background.py; a compaction cut by the process's exit is
    finished by the next one), its error raised by the `collect` that takes it."""

    def __init__(self, store: Store, settings: CompactionSettings, echo=None) -> None:
        self.store, self.settings, self.echo = store, settings, echo
        self._job = Background(daemon=True)
        self._last_update: int | None = None
        self.compactions = 0
        self.seconds = 0.0

    def due(self, update: int, consumed_bytes: int) -> bool:
        s = self.settings
        if not s.enabled:
            return False
        if self._last_update is None:
            self._last_update = update - (update % s.every_updates if s.every_updates else 0)
        if s.every_updates and update - self._last_update >= s.every_updates:
            return True
        return bool(s.min_mib) and consumed_bytes >= s.min_mib * 2**20

    def maybe_start(self, ledger_table, update: int, consumed_bytes: int = 0) -> bool:
        """Start a compaction of the shards consumed by published updates ≤ `update` if one
        is due and none is pending (running, or its result not yet collected);
        `ledger_table()`: the whole ledger, asked only then. Returns whether one started."""
        if self._job.pending or not self.due(update, consumed_bytes):
            return False
        refs, rows = consumed_shards(self.store.list_shards(), ledger_table(), update)
        self._last_update = update
        if not refs:
            return False
        from gagpo.learner.lease import check_lease

        segment_bytes = int(self.settings.segment_mib * 2**20)
        check = functools.partial(check_lease, self.store)
        job = functools.partial(
            compact, self.store, refs, rows, check=check, segment_bytes=segment_bytes
        )
        self._job.submit(job, name="gagpo-compaction")
        return True

    def collect(self, wait: bool = False) -> CompactionResult | None:
        """The result of the finished compaction (None if none finished); with `wait`,
        wait for a running one. A compaction that failed raises its error here."""
        result = self._job.wait() if wait else self._job.poll()
        if result is not None and result.generation is not None:
            self.compactions += 1
            self.seconds += result.seconds
            if self.echo is not None:
                self.echo(describe(result))
        return result


def describe(result: CompactionResult) -> str:
    if result.generation is None:
        return "compaction: nothing to move" + (
            f" (removed {result.recovered} file(s) a killed compaction left)"
            if result.recovered
            else ""
        )
    parts = [
        f"compaction {result.generation}: {result.shards} shard(s), {result.groups} group(s), "
        f"{result.rows} steps into {result.segments} segment(s) "
        f"({result.bytes_written / 2**20:.1f} MiB) in {result.seconds:.1f} s"
    ]
    if result.quarantined:
        parts.append(f"{len(result.quarantined)} shard(s) quarantined")
    if result.skipped:
        parts.append(f"{result.skipped} shard(s) left in the inbox")
    if result.recovered:
        parts.append(f"removed {result.recovered} file(s) a killed compaction left")
    return "; ".join(parts)


def published_update(store: Store) -> int:
    """The learner update that made LATEST's version (0: nothing published but v0)."""
    import json

    from gagpo.schemas import layout

    latest = store.policies.latest()
    if not latest:
        return 0
    try:  # learner/checkpoint.py's record, read without importing torch
        lineage = json.loads(store.read_bytes(layout.lineage(store.root, latest)))
    except FileNotFoundError:
        lineage = {}
    return int(lineage.get("update", latest))


def compact_store(
    url: str, run_id: str | None, everything: bool, settings: CompactionSettings, echo=print
) -> CompactionResult:
    """What `gagpo compact` does: take the lease, choose the shards, compact them."""
    from gagpo.learner.lease import acquire, check_lease

    if run_id is not None and not re.fullmatch(RUN_ID_PATTERN, run_id):
        # '' would list every run's shards: "only this run" must name one
        raise GagpoError(
            f"--run {run_id!r} is not a run id; accepted: a run id as gagpo-actors names it "
            "(letters, digits, '_', '.', '-'; at most 64), or no --run for every run"
        )
    store = Store(url)
    if not store.exists(store.root):
        raise GagpoError(f"store {url!r} does not exist; accepted: an existing store root")
    store.ensure_writable()
    lease = acquire(store)
    try:
        refs = store.list_shards(run_id)
        ledger = read_ledger(store)
        if everything:
            ids = pa.array(sorted({r.shard_id for r in refs}), pa.string())
            rows = ledger.filter(pc.is_in(ledger[C.SHARD_ID], value_set=ids))
            if rows.num_rows:  # never rows of an unpublished update
                rows = rows.filter(pc.less_equal(rows[C.LEDGER_UPDATE], published_update(store)))
        else:
            refs, rows = consumed_shards(refs, ledger, published_update(store))
        echo(
            f"compacting {len(refs)} shard(s) of {url}"
            + ("" if everything else " (consumed by the learner; --all for every shard)")
        )
        bar = _progress(len(refs))
        result = compact(
            store,
            refs,
            rows,
            check=lambda: check_lease(store),
            progress=bar,
            segment_bytes=int(settings.segment_mib * 2**20),
        )
        if result.groups_archived and store.exists(tail_ledger_path(store)):
            _drop_from_tail(store, result.groups_archived)
        echo(describe(result))
        return result
    finally:
        lease.release()


def _drop_from_tail(store: Store, archived: set[str]) -> None:
    """Rewrite the tail ledger without the rows the archive now holds (its metadata, the
    learner's settings for the actors' throttle, kept)."""
    tail = store.read_table(tail_ledger_path(store))
    keep = pc.invert(pc.is_in(tail[C.GROUP_ID], value_set=pa.array(sorted(archived), pa.string())))
    store.write_parquet(
        tail.filter(keep), tail_ledger_path(store), dict(tail.schema.metadata or {})
    )


def _progress(total: int):
    """A progress line on stderr for long compactions (a terminal only)."""
    if total < 200 or not sys.stderr.isatty():
        return None
    start = time.monotonic()

    def show(done: int, n: int) -> None:
        if done % 100 and done != n:
            return
        rate = done / max(time.monotonic() - start, 1e-9)
        print(
            f"\r  read {done}/{n} shards ({rate:.0f}/s)",
            end="\n" if done == n else "",
            file=sys.stderr,
            flush=True,
        )

    return show


# --segment-mib as the learner's [compaction] field, checked by its model: a bad value
# (nan, inf, 1e12, text) is one line naming the field, as `gagpo learner` gives it.
_SEGMENT_OPTION = ModelOptions(CompactionSettings, skip=("every_updates", "min_mib"))


@click.command(
    "compact", cls=OneLineCommand, context_settings={"help_option_names": ["-h", "--help"]}
)
@store_option()
@click.option("--run", "run_id", metavar="ID", help="Only the shards of this run.")
@click.option(
    "--all",
    "everything",
    is_flag=True,
    help="Every shard, consumed or not (stores no follow-mode learner will read again).",
)
@_SEGMENT_OPTION
def compact_command(store_url: str, run_id: str | None, everything: bool, **values) -> None:
    """Move a store's consumed shards out of the inbox (shards/) into archive segments.

    Takes the store's lease, so it never runs beside a learner or another compactor. The
    views of `gagpo sql`, `gagpo advantages --store`, replays and reports read archive and
    inbox as one; a killed compaction is finished by the next one. Layout: docs/store.md.
    """
    settings = _SEGMENT_OPTION.load(None, (), values, section="compaction")
    compact_store(store_url, run_id, everything, settings)


def main() -> None:
    run_cli(compact_command, "gagpo compact")
