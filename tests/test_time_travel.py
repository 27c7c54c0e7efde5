"""`--as-of-update U`: the store as it stood after learner update U (docs/store.md).

A learner trains 6 updates of B = 2 groups and compacts after update 4, so the groups
sit partly in archive segments, partly in the inbox, their ledger rows partly in the
archive. Group ids run against the shard order, so the archive (group-id order) and the
inbox (shard order) list the groups in the opposite order to the one they were trained
in: a replay that batches in file order would not match the original.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from gagpo.inspection.sql import query_store
from gagpo.learner.config import LearnerConfig
from gagpo.learner.feed import Ledger
from gagpo.learner.train import train
from gagpo.pipeline.config import GagpoConfig
from gagpo.pipeline.recompute import recompute_store
from gagpo.schemas import columns as C
from gagpo.schemas.errors import GagpoError
from gagpo.storage.archive import step_files
from gagpo.storage.store import Store
from tests.helpers.learner import GROUP_SIZE, shard_table, tiny_model_dir

pytestmark = pytest.mark.usefixtures("one_torch_thread")

UPDATES, B, SHARDS = 6, 2, 6
GAGPO = str(Path(sys.executable).with_name("gagpo"))


def reversed_groups(shard_id: str, i: int) -> pa.Table:
    """A shard whose group ids sort in the reverse of the shard order."""
    table = shard_table(shard_id, groups=B)
    for column in (C.GROUP_ID, C.TRAJ_ID):
        values = pc.utf8_replace_slice(table[column], 0, 0, f"{99 - i:02d}-")
        table = table.set_column(table.schema.get_field_index(column), column, values)
    return table


def learner_config(store: str, **extra) -> LearnerConfig:
    return LearnerConfig(
        store=store,
        policy=str(tiny_model_dir()),
        batch_groups=B,
        max_staleness=100,
        lr=3e-3,
        micro_batch_tokens=96,
        poll_interval_s=0.05,
        idle_timeout_s=1.0,
        **extra,
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Store:
    root = tmp_path_factory.mktemp("trained") / "store"
    store = Store(str(root))
    for i in range(SHARDS):
        store.write_shard(reversed_groups(f"s{i:03d}", i), group_size=GROUP_SIZE)
    store.policies.publish_base(str(tiny_model_dir()))
    store.policies.set_latest(0)
    train(learner_config(str(root), updates=UPDATES, compaction={"every_updates": 4, "min_mib": 0}))
    files = step_files(store)  # the learner compacted: archive and inbox both hold groups
    assert files.segments and files.shards
    return store


def groups_by_update(store: Store) -> dict[int, set[str]]:
    ledger = pl.from_arrow(Ledger.load(store).table())
    return {u: set(g) for u, g in ledger.group_by("update").agg(pl.col(C.GROUP_ID)).iter_rows()}


def test_sql_as_of_update_sees_the_groups_of_updates_up_to_u(trained: Store) -> None:
    by_update = groups_by_update(trained)
    assert sorted(by_update) == list(range(1, UPDATES + 1))
    for u in (1, 3, UPDATES):
        want = set().union(*(by_update[k] for k in range(1, u + 1)))
        got = query_store(trained.url, "SELECT DISTINCT group_id FROM steps", as_of_update=u)
        assert set(got[C.GROUP_ID].to_pylist()) == want
        metrics = query_store(
            trained.url, 'SELECT max("update") AS u FROM learner_metrics', as_of_update=u
        )
        assert metrics["u"].to_pylist() == [u]
        versions = query_store(
            trained.url, "SELECT max(version) AS v FROM policy_versions", as_of_update=u
        )
        assert versions["v"].to_pylist() == [u]
    everything = query_store(trained.url, "SELECT count(DISTINCT group_id) AS n FROM steps")
    assert everything["n"].to_pylist() == [SHARDS * B]


def test_as_of_update_out_of_range_is_one_line(trained: Store) -> None:
    with pytest.raises(GagpoError, match=r"--as-of-update 99 is out of range; accepted: 0 … 6"):
        query_store(trained.url, "SELECT 1", as_of_update=99)
    done = subprocess.run(
        [GAGPO, "sql", "--store", trained.url, "--as-of-update", "99", "SELECT 1"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_advantages_as_of_update_writes_those_groups_under_their_own_tag(trained: Store) -> None:
    config = GagpoConfig()
    recompute_store(trained.url, None, config, as_of_update=3)
    full = recompute_store(trained.url, None, config)
    assert full.shards >= 2
    root = Path(trained.root) / "advantages"
    by_update = groups_by_update(trained)
    want = by_update[1] | by_update[2] | by_update[3]
    as_of = pl.read_parquet(root / f"{config.tag}@u3" / "*.parquet")
    assert set(as_of[C.GROUP_ID].to_list()) == want
    every = pl.read_parquet(root / config.tag / "*.parquet").filter(
        pl.col(C.GROUP_ID).is_in(list(want))
    )
    keys = [C.TRAJ_ID, C.STEP]
    # per group, the same numbers as the full recompute (group normalisation stays per group)
    assert (
        as_of.sort(keys)
        .select([*keys, C.ADVANTAGE])
        .equals(every.sort(keys).select([*keys, C.ADVANTAGE]))
    )


def test_replay_as_of_update_trains_the_original_batches(trained: Store, tmp_path: Path) -> None:
    """--replay S --as-of-update 4 with the same B: update k trains the groups the original
    learner trained in its update k, for k = 1..4."""
    replay = tmp_path / "replay"
    summary = train(
        learner_config(str(replay), updates=4, replay=trained.url, replay_as_of_update=4)
    )
    assert summary.updates == 4
    original, again = groups_by_update(trained), groups_by_update(Store(str(replay)))
    assert again == {k: original[k] for k in range(1, 5)}


def test_replay_as_of_update_needs_replay() -> None:
    with pytest.raises(ValueError, match="replay_as_of_update needs replay"):
        learner_config("x", updates=1, replay_as_of_update=2)
