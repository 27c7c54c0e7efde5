"""Checks that fail a learner run at once, before torch is imported, instead of letting
it wait for data or a base policy that will never come (issue 14, "no hangs")."""

from __future__ import annotations

from gagpo.schemas import layout
from gagpo.schemas.errors import GagpoError
from gagpo.schemas.policy import PolicySpec
from gagpo.storage.store import Store


def check_start(cfg) -> None:
    """The policy (a preset, a folder or a hub id), and something to resume (--resume) or
    replay (--replay)."""
    PolicySpec.parse(cfg.policy)
    if cfg.resume:
        store = Store(cfg.store)
        if not store.fs.exists(store.root) or not any(
            store.fs.exists(folder) for folder in layout.data_folders(store.root)
        ):
            raise GagpoError(
                f"--resume: store {cfg.store!r} is missing or empty, nothing to resume; accepted: "
                "a store a learner or actors already wrote (or drop --resume to start a run)"
            )
    if cfg.replay is not None:
        source = Store(cfg.replay)
        from gagpo.storage.archive import step_files

        if not source.fs.exists(source.root) or step_files(source).empty:
            raise GagpoError(
                f"--replay: store {cfg.replay!r} is missing or holds no committed shard; accepted: "
                "a store with shards/run=<id>/<shard>.parquet written by gagpo-actors (or "
                "archive segments made from them by gagpo compact)"
            )
        if cfg.replay_as_of_update is not None:
            from gagpo.storage.archive import groups_as_of

            groups_as_of(source, cfg.replay_as_of_update)  # one line for an update out of range
