"""Held-out evaluation reads through the Store: the same totals on a local store and on
S3, and a version of an object store is fetched into the local policy cache to be played."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from gagpo.actors.config import ActorConfig
from gagpo.schemas import columns as C
from gagpo.schemas.layout import COMPLETE
from gagpo.storage.store import Store
from gagpo.workflows import evaluate
from tests.helpers.steps import make_steps


def known_shard() -> pa.Table:
    """2 groups × 3 rollouts of 2, 3, 4 steps (18 steps, reward 1 on each of the 6 last
    steps); the first step of every rollout is an invalid reply (6 of 18)."""
    table = make_steps(shard_id="e0")
    invalid = pc.equal(table[C.STEP], 0)
    i = table.schema.get_field_index(C.ACTION_VALID)
    return table.set_column(i, table.schema.field(i), pc.invert(invalid))


def fill(store: Store) -> Store:
    store.write_shard(known_shard(), group_size=3)
    return store


def test_rollout_totals_on_a_local_store(tmp_path: Path):
    assert evaluate.rollout_totals(fill(Store(str(tmp_path / "s")))) == (12, 18, 6.0)


def test_rollout_totals_and_versions_on_s3(s3_endpoint, tmp_path: Path, monkeypatch):
    store = fill(Store(f"s3://gagpo/{tmp_path.name}-eval", skip_instance_cache=True))
    assert evaluate.rollout_totals(store) == (12, 18, 6.0)
    for v in (0, 1, 2):
        store.commit_bytes(store.path("policy", f"v{v}", "config.json"), b"{}")
        store.commit_bytes(store.path("policy", f"v{v}", COMPLETE), b"{}")
    store.policies.set_latest(2)
    assert evaluate.versions_to_evaluate(store, 2) == [0, 2]
    played = []
    monkeypatch.setenv("GAGPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(evaluate, "play", lambda actors: played.append(actors.policy) or {})
    row = evaluate.evaluate_version(store, 2, ActorConfig(store="x"), groups=1, seed=7)
    assert row == {"policy_version": 2, "task_seed": 7}
    (folder,) = map(Path, played)
    assert (
        folder.is_relative_to(tmp_path / "cache" / "policies")
        and (folder / "config.json").is_file()
    )
