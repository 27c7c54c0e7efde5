"""The fsspec file system under a store (storage/store.py): opening it for a URL with
listing caches off, globbing below a root taken as a path, and the local file writes a
commit makes durable (fsync of the file, then of its folder)."""

from __future__ import annotations

import contextlib
import glob
import os
import re
import time

import fsspec
from fsspec.utils import glob_translate


def open_fs(url: str, storage_options: dict) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem of `url` with directory-listing caches off: actors and learners on
    other machines add files all the time, and a cached listing would hide them (s3fs,
    gcsfs, adlfs and the HTTP backend cache listings by default)."""
    try:
        # A fresh instance per Store: fsspec's instance cache would hand back a filesystem
        # built for another endpoint or credentials than the environment now names.
        options = {"use_listings_cache": False, "skip_instance_cache": True, **storage_options}
        return fsspec.core.url_to_fs(url, **options)
    except TypeError:  # a backend that takes no listing-cache option: it has no such cache
        return fsspec.core.url_to_fs(url, **storage_options)


def escaped(path: str) -> str:
    """`path` as a glob pattern that matches only itself (`[` → `[[]`, `*` → `[*]`, …), for
    fsspec calls that expand their argument as a pattern (get, on every backend)."""
    return glob.escape(path) if glob.has_magic(path) else path


def glob_below(fs: fsspec.AbstractFileSystem, root: str, pattern: str) -> list[str]:
    """fsspec's glob of `pattern`, with `root`, where `pattern` starts, taken as a path.

    fsspec reads every `[`, `*` and `?` of a pattern as a wildcard: a store at
    runs/glob[1]store would list nothing (or runs/glob1store's files). A root holding one
    is escaped (glob.escape: `[` → `[[]`) and the listing starts at the root, as it does for
    any other store: fsspec would start at the folder above the first wildcard, listing
    every sibling store. Other roots keep fsspec's own glob."""
    prefix = root.rstrip("/") + "/"
    if not glob.has_magic(root) or not pattern.startswith(prefix):
        return fs.glob(pattern)
    rest = pattern[len(prefix) :]
    if not glob.has_magic(rest):
        return [pattern] if fs.exists(pattern) else []
    first = min(i for i in (rest.find(c) for c in "*?[") if i >= 0)
    base = rest[: rest.rfind("/", 0, first) + 1]  # the literal folders before the first wildcard
    depth = None if "**" in rest else rest[len(base) :].count("/") + 1
    regex = re.compile(glob_translate(glob.escape(prefix) + rest))
    found = fs.find(prefix + base, maxdepth=depth, withdirs=True)
    return sorted(p for p in found if regex.match(p))


def mtime(entry: dict) -> float:
    """Modification time of a listing entry, in seconds since the epoch (now if unknown)."""
    for key in ("mtime", "LastModified", "last_modified", "created"):
        value = entry.get(key)
        if value is not None:
            return value.timestamp() if hasattr(value, "timestamp") else float(value)
    return time.time()


def fsync_dir(path: str) -> None:
    """Persist a rename: fsync the directory entry (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: str, data: bytes) -> None:
    """Write `data` to a new local file and fsync it before it is renamed or linked."""
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
