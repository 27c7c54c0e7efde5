"""Folders of the store written file by file: `.complete` last, and the sharded commit.

A folder (a policy version, a training state) is written through fsspec file by file, then
its `.complete` marker is committed last (`put_folder`); only then is it pointed at
(`policy/LATEST`) or counted (a training state). A reader that follows a pointer therefore
always finds a complete folder, on a local disk as on an object store, whatever instant the
writer was killed at. A folder without its marker is a crashed attempt: it is removed
before being rewritten (`remove_folder` unmarks first, then deletes).

The sharded commit (`commit_shard`) is the same protocol for a folder that several
processes write at once, each its own files (FSDP: each rank the tensors or the optimiser
moments it owns; learner/publish.py `write_shard`, learner/state.py's sharded state):

    every rank     uploads its own files
    rank r > 0     then commits `.rank-<r>` (the bytes it wrote)
    rank 0         uploads its files, waits for every other rank's `.rank-<r>`
                   (RANK_WAIT_S at most), then commits `.complete` naming all the files

so a folder missing any rank's file is never complete. A full store (StoreFullError) on
rank 0 removes the partial folder: nothing of it is left, and nothing points at it.
"""

from __future__ import annotations

import functools
import json
import os
import posixpath
import time
from collections.abc import Callable
from pathlib import Path

from gagpo.schemas import layout
from gagpo.schemas.errors import GagpoError, StoreFullError
from gagpo.storage.faults import fault_point

RANK_WAIT_S = 1800.0  # a rank that never writes its file died: torchrun stops the job


def put_folder(
    store,
    local_dir: str | Path,
    remote_dir: str,
    *,
    phase: str,
    fault: Callable[[str], None] = fault_point,
) -> None:
    """Upload every file of `local_dir` to `remote_dir`, then commit `.complete`. A full
    disk removes the partial folder: nothing of it is left, and nothing points at it.
    `fault(phase)`: the crash tests' hold point between the files and the marker."""
    store.remove(remote_dir, recursive=True)  # an earlier attempt that never completed
    try:
        upload_files(store, local_dir, remote_dir)
        fault(phase)
        commit_marker(store, remote_dir, sorted(os.listdir(local_dir)))
    except StoreFullError:
        store.remove(remote_dir, recursive=True)
        raise


def upload_files(store, local_dir: str | Path, remote_dir: str) -> None:
    store.makedirs(remote_dir)
    for name in sorted(os.listdir(local_dir)):
        source, dest = os.path.join(local_dir, name), posixpath.join(remote_dir, name)
        store.retrying(f"uploading {dest}", functools.partial(store.fs.put_file, source, dest))
    store.make_readable(remote_dir)  # 0644/0755: actors may run as other users


def commit_marker(store, remote_dir: str, files: list[str]) -> None:
    """The folder is whole: `.complete`, naming its files, committed last."""
    marker = {"completed_at": time.time(), "files": files}
    store.commit_bytes(layout.complete(remote_dir), json.dumps(marker).encode())
    store.make_readable(layout.complete(remote_dir))


def is_complete(store, remote_dir: str) -> bool:
    return store.exists(layout.complete(remote_dir))


def remove_folder(store, remote_dir: str) -> None:
    """Unmark first, then delete: a folder is never complete-but-partial."""
    store.remove(layout.complete(remote_dir))
    store.remove(remote_dir, recursive=True)


def folder_bytes(folder: str | Path) -> int:
    return sum(path.stat().st_size for path in Path(folder).iterdir() if path.is_file())


# --- the sharded commit -------------------------------------------------------------------
def rank_done(remote: str, rank: int) -> str:
    """The marker rank `rank` commits once its files of the folder `remote` are in."""
    return posixpath.join(remote, f".rank-{rank}")


def await_ranks(store, remote: str, world: int, *, wait_s: float = RANK_WAIT_S) -> None:
    """Rank 0's wait for every other rank's marker in `remote`, bounded by `wait_s`."""
    deadline = time.monotonic() + wait_s
    for rank in range(1, world):
        while not store.exists(rank_done(remote, rank)):
            if time.monotonic() > deadline:
                raise GagpoError(
                    f"rank {rank} never wrote its file of {remote} within {wait_s:.0f} s"
                )
            time.sleep(0.05)


def commit_shard(
    store,
    local_dir: str | Path,
    remote: str,
    *,
    rank: int,
    world: int,
    files: list[str],
    phase: str,
    fault: Callable[[str], None] = fault_point,
) -> int:
    """This rank's part of the sharded commit of `remote` (module docstring): upload the
    files of `local_dir`; rank r > 0 then commits `.rank-<r>`, rank 0 waits for every
    rank's marker and commits `.complete` naming `files` (every rank's). Returns the bytes
    this rank wrote and, on rank 0, the other ranks' (their markers say them).
    `fault(phase)`: the crash tests' hold point before `.complete`."""
    written = folder_bytes(local_dir)
    if rank != 0:
        upload_files(store, local_dir, remote)
        store.commit_bytes(rank_done(remote, rank), json.dumps(written).encode())
        return written
    try:
        upload_files(store, local_dir, remote)
        await_ranks(store, remote, world)
        fault(phase)
        commit_marker(store, remote, sorted(files))
    except StoreFullError:
        store.remove(remote, recursive=True)
        raise
    return written + sum(_marked_bytes(store, remote, r) for r in range(1, world))


def _marked_bytes(store, remote: str, rank: int) -> int:
    """The bytes rank `rank`'s marker says it wrote (0 for a marker of an older writer)."""
    try:
        value = json.loads(store.read_bytes(rank_done(remote, rank)))
    except ValueError:
        return 0
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
