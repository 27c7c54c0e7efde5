"""Archive segments read and checked (storage/archive.py names them; readers and the
compactor open them here): a segment is validated on read as a shard is, and a bad one is
refused with one line, never quarantined nor skipped (its manifest names it)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from gagpo.schemas import columns as C
from gagpo.schemas.errors import GagpoError, ValidationError, first_line
from gagpo.schemas.validate import validate_footer, validate_steps
from gagpo.storage.store import Store, parquet_table


def read_segment(store: Store, path: str, columns: list[str] | None = None) -> pa.Table:
    """An archive segment's steps (only `columns`, when given), validated on read as a
    shard is (schemas/validate.py): every check over the whole file when it is read whole,
    the footer's (schema version, group size, the contract's columns and types) when only
    some columns are. A bad segment raises ValidationError with the reason; the archive is
    never quarantined (its manifest names the file): readers refuse it (`segment_refused`).
    A link, or a path outside the store, is a one-line OutsideStoreError (Store.confine);
    FileNotFoundError propagates (a compaction merged it: resolve again)."""
    data = store.read_bytes(path)
    try:
        footer = pq.ParquetFile(pa.BufferReader(data)).schema_arrow
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise ValidationError(f"unreadable Parquet file ({first_line(exc)})") from None
    validate_footer(footer)
    try:
        table = parquet_table(data, columns)
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise ValidationError(f"unreadable Parquet file ({first_line(exc)})") from None
    if columns is None:
        validate_steps(table, table.schema.metadata)
    return table


def file_groups(store: Store, path: str) -> set[str]:
    """The group ids of the steps file `path`, from its group_id column alone (a ranged
    read: a large segment is not read whole); empty for a file that is missing, not the
    store's own (Store.is_own) or does not decode."""
    if not store.is_own(path):
        return set()
    try:
        with store.fs.open(path, "rb") as handle:
            table = pq.ParquetFile(handle).read(columns=[C.GROUP_ID], use_threads=False)
        return set(table[C.GROUP_ID].unique().to_pylist())
    except (OSError, ValueError, KeyError, pa.ArrowException):
        return set()


def segment_refused(path: str, reason: str) -> GagpoError:
    """The one line for a segment that fails validation (see docs/store.md)."""
    return GagpoError(
        f"archive segment {path} cannot be used: {reason}; refused: nothing was read from it "
        "or changed (restore the file, or the store, from a copy)"
    )


def checked_segment(store: Store, path: str, columns: list[str] | None = None) -> pa.Table:
    """`read_segment`, a bad segment refused with one line (GagpoError)."""
    try:
        return read_segment(store, path, columns)
    except ValidationError as exc:
        raise segment_refused(path, str(exc)) from None
