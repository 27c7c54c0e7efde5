"""The archive's segments as DuckDB reads them: through a file system that can only read.

DuckDB has no read-only variant of `allowed_paths`: a file it may read, it may also
write (`COPY … TO`, however the statement is spelled: prepared, explained, nested). So
the segments are never named to DuckDB by their local paths. Each is named by a URL of
the `gagposegment://` protocol, served by `ReadOnlySegments`, an fsspec file system
registered on the connection that opens the listed files for reading and has no way to
write, create, move or remove anything. The connection's `allowed_paths` are those URLs
and nothing else, and external access is off: a local path, a `file://` URL or any other
file is refused by DuckDB, and a segment's URL reaches a file system without writes.
"""

from __future__ import annotations

import io
import os
import threading
from datetime import UTC, datetime

from fsspec import AbstractFileSystem

PROTOCOL = "gagposegment"
_PREFIX = f"{PROTOCOL}://"


def segment_url(path: str) -> str:
    """The URL under which DuckDB reads the local segment `path`."""
    return _PREFIX + os.path.abspath(path)


class ReadOnlySegments(AbstractFileSystem):
    """Reads the listed local files, nothing else; every write is refused.

    Only the reading half of fsspec's interface is implemented: AbstractFileSystem's
    writing methods either open a file for writing (refused by `_open`) or are not
    implemented, so no method of this class can change a file.
    """

    protocol = (PROTOCOL,)
    root_marker = "/"
    cachable = False  # one instance per connection, each with its own list

    def __init__(self, paths: list[str], **kwargs):
        super().__init__(**kwargs)
        self._paths = frozenset(os.path.abspath(p) for p in paths)

    @classmethod
    def _strip_protocol(cls, path):
        path = str(path)
        return path[len(_PREFIX) :] if path.startswith(_PREFIX) else path

    def _listed(self, path: str) -> str:
        path = self._strip_protocol(path)
        if path not in self._paths:
            raise PermissionError(f"read-only segments: {path} is not a listed segment")
        return path

    def _open(self, path, mode="rb", **kwargs):
        if mode != "rb":
            raise PermissionError(
                f"read-only segments: {self._strip_protocol(path)} is not writable"
            )
        return SegmentFile(self._listed(path))

    def info(self, path, **kwargs):
        # os.stat follows no more than the store's own listing did (sql_sources.inside).
        path = self._listed(path)
        stat = os.stat(path)
        return {"name": path, "size": stat.st_size, "type": "file", "mtime": stat.st_mtime}

    def ls(self, path, detail=True, **kwargs):
        # Listing is lookup of one listed file: a folder is never listed.
        info = self.info(path)
        return [info] if detail else [info["name"]]

    def glob(self, path, **kwargs):
        """A listed segment that exists, as itself; no pattern is ever expanded."""
        try:
            return [self.info(path)["name"]]
        except FileNotFoundError:
            return []

    def modified(self, path):
        return datetime.fromtimestamp(self.info(path)["mtime"], tz=UTC)


class SegmentFile(io.RawIOBase):
    """A segment opened for reading, whose position is each thread's own.

    DuckDB reads a file through Python as a seek, then a read, on one handle that its
    threads share (each call takes the GIL on its own): with one position, another
    thread's seek in between makes a read return the wrong bytes. Here each thread seeks
    and reads at its own position with `os.pread`, which moves no shared offset."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self._fd = os.open(path, os.O_RDONLY)
        self._size = os.fstat(self._fd).st_size
        self._local = threading.local()

    @property
    def _pos(self) -> int:
        return getattr(self._local, "pos", 0)

    @_pos.setter
    def _pos(self, value: int) -> None:
        self._local.pos = value

    @property
    def size(self) -> int:
        return self._size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, size: int | None = -1) -> bytes:
        size = self._size - self._pos if size is None or size < 0 else size
        data = os.pread(self._fd, size, self._pos)
        self._pos += len(data)
        return data

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            os.close(self._fd)
        super().close()
