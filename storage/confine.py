"""Confinement: a store reads, writes and removes only its own files, under its root
and never through a symbolic link (docs/store.md, "A store's files never reach
outside it"). `Confined` is the part of storage/store.py's Store that decides it."""

from __future__ import annotations

import os
import posixpath

from gagpo.schemas.errors import GagpoError

LINKED_FOLDER = "lies in a folder reached through a symbolic link"


class OutsideStoreError(GagpoError):
    """A path that is not the store's own: outside its root, or through a symbolic link."""


class Confined:
    """The confinement checks of a store: `url`, `root` and `is_local` are the store's."""

    url: str
    root: str
    is_local: bool

    def confine(self, paths: list[str], what: str, *, link_ok: bool = False) -> None:
        """Refuse, with one line (OutsideStoreError), unless every one of `paths` is a file
        of this store: under its root once `..` is resolved and, on a local store, reached
        through no symbolic link (neither a folder on the way nor, unless `link_ok`, the
        file itself). Reads, commits and removals of paths built from data (manifests,
        moved lists, ledgers) go through here, so a hostile entry never reaches outside."""
        real_root = os.path.realpath(self.root) if self.is_local else ""
        folders: dict[str, bool] = {}  # folder → reached without a link (one check per folder)
        for path in paths:
            why = self._outside(path, real_root, folders, link_ok)
            if why is not None:
                shown = path if len(path) <= 120 else f"{path[:120]}…"
                raise OutsideStoreError(
                    f"store {self.url}: {what}: {shown!r} {why}; refused: a store reads, "
                    "writes and removes only its own files, under its root and never "
                    "through a symbolic link"
                )

    def is_own(self, path: str) -> bool:
        """Whether `path` is a file of this store (`confine` would let it through)."""
        real_root = os.path.realpath(self.root) if self.is_local else ""
        return self._outside(path, real_root, {}, False) is None

    def _outside(self, path: str, real_root: str, folders: dict, link_ok: bool) -> str | None:
        """Why `path` is not the store's own (see `confine`); None when it is."""
        if not isinstance(path, str) or not path or "\0" in path:
            return "is no path"
        relative = posixpath.relpath(posixpath.normpath(path), self.root)
        if relative == ".." or relative.startswith("../") or posixpath.isabs(relative):
            return "is outside the store"
        if not self.is_local:
            return None  # object stores have keys, no links
        folder = posixpath.dirname(relative)
        if folder not in folders:
            expected = posixpath.normpath(posixpath.join(real_root, folder))
            folders[folder] = os.path.realpath(posixpath.join(self.root, folder)) == expected
        if not folders[folder]:
            return LINKED_FOLDER
        if not link_ok and relative != "." and os.path.islink(path):
            return "is a symbolic link"
        return None
