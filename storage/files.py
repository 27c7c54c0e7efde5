"""Local files and folders written whole or not at all (caches, `--out` files).

Both write under a hidden temporary name in the destination's own folder and rename it
into place, so a reader sees the old content or the new, never part of it, and writers
racing on one destination never mix their bytes. A failure removes the temporary. The
store's commit (storage/store.py) uses the same temporary names and adds what a shared
store needs: fsync, retries, object stores, sweeping the leftovers of killed writers.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path

TEMP_PREFIX = ".tmp-"  # listings skip such names; Store.sweep_temporaries removes old ones


def temporary_beside(path: str) -> str:
    """A fresh hidden temporary name in `path`'s folder."""
    folder, name = posixpath.split(str(path))
    return posixpath.join(folder, f"{TEMP_PREFIX}{uuid.uuid4().hex}-{name}")


def atomic_write(path: str | Path, write: Callable[[Path], object]) -> Path:
    """Create or replace the local file `path` with what `write(temp)` writes to a
    temporary file beside it, renamed over `path` once `write` returns."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = Path(temporary_beside(str(path)))
    try:
        write(temp)
        os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)
    return path


def build_once(final: Path, write: Callable[[Path], object]) -> Path:
    """The local folder `final`, first built by `write(temp)` into an empty temporary
    folder beside it and renamed into place, if absent. When another process renamed its
    own folder there first, theirs is kept and ours discarded."""
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    temp = Path(tempfile.mkdtemp(prefix=f".{final.name}{TEMP_PREFIX}", dir=final.parent))
    try:
        write(temp)
        temp.chmod(0o755)  # mkdtemp's 0700 would hide a shared cache from other users
        try:
            os.rename(temp, final)
        except OSError:
            if not final.is_dir():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    return final
