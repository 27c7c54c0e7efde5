"""Policy versions in a store: which folders exist, which are complete, which were published.

One meaning of each word, used by the learner (publication, pruning, lineage checks),
held-out evaluation and the `policy_versions` SQL view (docs/design.md §3):

- a version *folder* is `policy/v<N>/`, complete or not (a crashed or in-flight
  publication has no `.complete` marker yet);
- a version is *stored* when its folder is complete: it can be loaded now;
- a version is *published* once `policy/LATEST` has reached it. The learner publishes
  versions in order, one per update, each complete before LATEST moves to it, and LATEST
  never moves back; so every version up to LATEST was published, including those whose
  folders pruning has since removed (published and not stored: *pruned*). v0, the base
  policy, is published by the actors, who commit its folder without moving LATEST: it is
  published once stored. A complete folder beyond LATEST (a publication killed between
  its marker and LATEST) is stored but not published.
"""

from __future__ import annotations

from gagpo.schemas import layout
from gagpo.schemas.store import Store


def version_folders(store: Store) -> list[int]:
    """Every version folder under policy/, complete or not, ascending."""
    versions = []
    for path in store.glob(layout.policy_dir(store.root, "*")):
        version = layout.parse_policy_dir(path)
        if version is None:
            continue
        if store.retrying(f"checking {path}", lambda p=path: store.fs.isdir(p)):
            versions.append(version)
    return sorted(versions)


def complete_versions(store: Store) -> list[int]:
    """The versions whose folders are complete (loadable now), ascending."""
    return [v for v in version_folders(store) if store.policies.has(v)]


def is_published(version: int, latest: int | None, stored: bool) -> bool:
    """Whether `version` was published: LATEST (`latest`, None before the learner's first
    publication) has reached it, or it is the base policy v0 and `stored`."""
    return (latest is not None and version <= latest) or (version == 0 and stored)
