"""Outcomes in the steps contract (schema 1.1 `won`): a lost game is a failure in the
actor summary and the SQL views; shards of schema 1.0 (no `won`) still read everywhere."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from gagpo.actors.actor import ActorSummary
from gagpo.actors.policies.base import Sample
from gagpo.actors.rollout import rollout_group
from gagpo.inspection.sql import open_store_db
from gagpo.pipeline.config import GagpoConfig
from gagpo.pipeline.recompute import recompute_store
from gagpo.schemas import columns as C
from gagpo.schemas.errors import ValidationError
from gagpo.schemas.validate import validate_steps
from gagpo.storage.store import Store
from tests.helpers.steps import make_steps
from tests.helpers.textworld import tw_make


class ScriptedPolicy:
    """A policy backend whose rollout j replies `scripts[j][turn]` (equal-length scripts)."""

    version = 0
    model_dir = Path(".")

    def __init__(self, scripts: list[list[str]]) -> None:
        self.scripts, self.turn = scripts, 0

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return [1, 2, 3]

    def generate(self, prompts: list[list[int]], *, seed: int | None = None) -> list[Sample]:
        replies = [script[self.turn] for script in self.scripts[: len(prompts)]]
        self.turn += 1
        return [Sample(text, [7], [-0.5]) for text in replies]


def success_by_traj(store: Store) -> dict[str, tuple[bool, bool]]:
    """traj_id -> (success, won_derived) from the trajectories view."""
    con = open_store_db(store)
    rows = con.execute("SELECT traj_id, success, won_derived FROM trajectories").fetchall()
    return {traj: (success, derived) for traj, success, derived in rows}


@pytest.mark.slow
def test_a_lost_textworld_game_is_a_failure_everywhere(store_dir: Path) -> None:
    import textworld

    from gagpo.envs.textworld_env import TextWorld

    # A treasure hunt is lost by taking its wrong object (the quest's fail event).
    game = tw_make("treasure-2")
    made = textworld.Game.load(str(game.with_suffix(".json")))
    (fail,) = made.quests[0].fail_events
    wrong = made.infos[fail.condition.preconditions[0].arguments[0].name].name
    env = TextWorld(game_files=game)
    first, plan = env.reset(0), env.expert_plan()
    assert plan == [f"take {plan[0].split(' ', 1)[1]}"] and f"take {wrong}" in first.admissible

    policy = ScriptedPolicy([plan, [f"take {wrong}"]])  # rollout 0 wins, rollout 1 loses
    result = rollout_group(
        lambda: TextWorld(game_files=game),
        policy,
        task_seed=0,
        group_id="g",
        run_id="r",
        shard_id="s",
        group_size=2,
        history_window=2,
        sampling_seed=0,
    )
    columns = result.columns
    assert columns[C.DONE] == [True, True] and columns[C.WON] == [True, False]
    assert columns[C.TRUNCATED] == [False, False]
    summary = ActorSummary(run_id="r")
    summary.add(result)
    assert (summary.successes, summary.success_rate) == (1, 0.5)

    store = Store(str(store_dir))
    store.write_shard(pa.Table.from_pydict(columns, schema=C.STEPS_SCHEMA), group_size=2)
    assert success_by_traj(store) == {"g-0": (True, False), "g-1": (False, False)}
    con = open_store_db(store)
    assert con.execute("SELECT success_rate FROM groups").fetchall() == [(0.5,)]


def write_v1_0_shard(store: Store, table: pa.Table, group_size: int) -> None:
    """Commit `table` as a schema 1.0 writer did: no `won` column, version 1.0."""
    run_id, shard_id = table[C.RUN_ID][0].as_py(), table[C.SHARD_ID][0].as_py()
    metadata = {C.META_SCHEMA_VERSION: b"1.0", C.META_GROUP_SIZE: str(group_size).encode()}
    store.write_parquet(table.drop_columns([C.WON]), store.shard_path(run_id, shard_id), metadata)


def test_v1_0_shards_read_everywhere_with_won_derived(store_dir: Path) -> None:
    store = Store(str(store_dir))
    # Schema 1.0: rollout r0 of each group ends done with reward 0 (a lost game then).
    old = make_steps(run_id="old", shard_id="v10", groups=2, group_size=3)
    rewards = old[C.REWARD].to_pylist()
    last_of_r0 = [i for i, t in enumerate(old[C.TRAJ_ID].to_pylist()) if t.endswith("-r0")][1::2]
    for i in last_of_r0:
        rewards[i] = 0.0
    old = old.set_column(
        old.schema.get_field_index(C.REWARD), C.REWARD, pa.array(rewards, pa.float32())
    )
    write_v1_0_shard(store, old, group_size=3)
    # Schema 1.1: rollout r2 of its one group ended done with a reward but was not won.
    new = make_steps(run_id="new", shard_id="v11", groups=1, group_size=3)
    won = pc.and_(new[C.WON], pc.invert(pc.ends_with(new[C.TRAJ_ID], "-r2")))
    new = new.set_column(new.schema.get_field_index(C.WON), C.WON, won)
    store.write_shard(new, group_size=3)

    # Validation: 1.0 without `won` passes; 1.1 without it, or won before the end, does not.
    (v10,) = store.list_shards("old")
    assert C.WON not in store.read_shard(v10).column_names
    v11_meta = {C.META_SCHEMA_VERSION: C.STEPS_SCHEMA_VERSION.encode()}
    assert C.STEPS_SCHEMA_VERSION == "1.1"
    with pytest.raises(ValidationError, match=r"missing column.* of schema 1\.1: won"):
        validate_steps(new.drop_columns([C.WON]), v11_meta)
    early = new.set_column(new.schema.get_field_index(C.WON), C.WON, pa.array([True] * len(new)))
    with pytest.raises(ValidationError, match="won without done at row 0"):
        validate_steps(early, v11_meta)

    # Advantages: both shards, nothing quarantined.
    summary = recompute_store(store.url, None, GagpoConfig())
    assert summary.shards == 2 and summary.quarantined == []

    # SQL: v1.0 rows derive `won` from done and a positive last reward, and say so.
    got = success_by_traj(store)
    for g in (0, 1):
        assert got[f"v10-g{g}-r0"] == (False, True)
        assert got[f"v10-g{g}-r1"] == got[f"v10-g{g}-r2"] == (True, True)
    assert got["v11-g0-r0"] == got["v11-g0-r1"] == (True, False)
    assert got["v11-g0-r2"] == (False, False)  # done with reward 1, yet not won
    con = open_store_db(store)
    derived = con.execute(
        "SELECT shard_id, bool_and(won_derived), count(*) FILTER (WHERE won) FROM steps "
        "GROUP BY shard_id ORDER BY shard_id"
    ).fetchall()
    assert derived == [("v10", True, 4), ("v11", False, 2)]
