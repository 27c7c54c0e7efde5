"""`gagpo sql`: the views over a store with known values, and read-only confinement."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gagpo.inspection import sql
from gagpo.inspection.cli import inspect
from gagpo.schemas import columns as C
from gagpo.schemas.errors import GagpoError
from gagpo.schemas.layout import COMPLETE
from gagpo.storage.store import Store
from tests.helpers.sql import build_known_store, write_histograms
from tests.helpers.steps import make_steps

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs" / "inspect.md"


@pytest.fixture
def known_store(tmp_path) -> Store:
    return build_known_store(Store(str(tmp_path / "store")))


@pytest.fixture
def con(known_store):
    connection = sql.open_store_db(known_store)
    yield connection
    connection.close()


def rows(con, query: str) -> list[dict]:
    return sql.run_query(con, query).to_pylist()


# --- views ---------------------------------------------------------------------------
def test_steps_view_has_the_contract_columns(con):
    columns = [name for name, _ in sql.view_columns(con, "steps")]
    assert columns == [*C.STEPS_COLUMNS, "won_derived"]
    assert rows(con, "SELECT count(*) AS n FROM steps") == [{"n": 12}]


def test_advantages_view_unions_tags_with_an_estimator_column(con):
    names = [name for name, _ in sql.view_columns(con, "advantages")]
    assert names == ["estimator", *C.ADVANTAGES_COLUMNS, "pool_id"]
    got = rows(con, "SELECT estimator, count(*) AS n FROM advantages GROUP BY 1 ORDER BY 1")
    assert got == [{"estimator": "gagpo", "n": 5}, {"estimator": "gigpo", "n": 5}]
    got = rows(
        con,
        "SELECT advantage, td_residual FROM advantages "
        "WHERE estimator = 'gagpo' AND traj_id = 'b1' ORDER BY step",
    )
    assert [r["advantage"] for r in got] == [-0.3, 0.2, -0.3]
    assert [r["td_residual"] for r in got] == [-0.087, 0.03, 0.0]


def test_estimators_view_reads_file_metadata(con):
    got = rows(con, "SELECT * FROM estimators ORDER BY estimator")
    assert [(r["estimator"], r["name"], r["shards"]) for r in got] == [
        ("gagpo", "gagpo", 1),
        ("gigpo", "gigpo", 1),
    ]
    assert json.loads(got[0]["params"]) == {"gamma": 0.9, "lam": 0.8}
    assert sql.estimator_params(con)["gigpo"] == {"gamma": 0.95, "omega": 1.0}


def test_trajectories_view(con):
    got = {r["traj_id"]: r for r in rows(con, "SELECT * FROM trajectories")}
    assert set(got) == {"a0", "a1", "b0", "b1"}
    expect = {
        # traj: (env, version, length, return, success, truncated, invalid)
        "a0": ("grid", 0, 3, 1.0, True, False, 0),
        "a1": ("grid", 0, 4, 0.0, False, True, 1),
        "b0": ("house", 1, 2, 1.0, True, False, 0),
        "b1": ("house", 1, 3, 1.0, True, False, 0),
    }
    for traj, (env, version, length, ret, success, truncated, invalid) in expect.items():
        row = got[traj]
        assert (row["env"], row["policy_version"], row["length"]) == (env, version, length)
        assert (row["return"], row["success"], row["truncated"]) == (ret, success, truncated)
        assert row["invalid_actions"] == invalid
        assert row["group_id"] == ("gA" if traj.startswith("a") else "gB")


def test_groups_view(con):
    got = {r["group_id"]: r for r in rows(con, "SELECT * FROM groups")}
    a, b = got["gA"], got["gB"]
    assert (a["env"], a["policy_version"], a["rollouts"], a["steps"]) == ("grid", 0, 2, 7)
    assert (a["success_rate"], a["mean_return"], a["std_return"]) == (0.5, 0.5, 0.5)
    assert (a["min_return"], a["max_return"]) == (0.0, 1.0)
    assert (a["states"], a["singleton_states"]) == (5, 3)
    assert a["singleton_rate"] == pytest.approx(3 / 7)
    assert (b["rollouts"], b["steps"], b["success_rate"], b["std_return"]) == (2, 5, 1.0, 0.0)
    assert (b["states"], b["singleton_states"], b["singleton_rate"]) == (2, 0, 0.0)


def test_state_pools_use_stored_returns_per_estimator(con):
    got = {
        (r["estimator"], r["state_key"]): r
        for r in rows(con, "SELECT * FROM state_pools WHERE group_id = 'gB'")
    }
    assert set(got) == {("gagpo", "h0"), ("gagpo", "h1"), ("gigpo", "h0"), ("gigpo", "h1")}
    h0 = got[("gagpo", "h0")]
    assert (h0["visits"], h0["trajectories"]) == (3, 2)
    assert h0["value_proxy"] == pytest.approx(0.87)
    assert (h0["return_min"], h0["return_max"]) == (0.81, 0.9)
    assert h0["return_std"] == pytest.approx(math.sqrt(((0.03) ** 2 * 2 + 0.06**2) / 3))
    assert got[("gigpo", "h0")]["value_proxy"] == pytest.approx((0.95 + 0.9025 + 0.95) / 3)
    assert got[("gagpo", "h1")]["return_std"] == 0.0


def test_state_pools_fall_back_to_sql_returns_without_advantages(con):
    got = {r["state_key"]: r for r in rows(con, "SELECT * FROM state_pools WHERE group_id = 'gA'")}
    assert all(r["estimator"] is None for r in got.values())
    # γ = 0.95: a0 returns 0.9025, 0.95, 1; a1 returns 0.
    assert got["s0"]["visits"] == 2 and got["s0"]["trajectories"] == 2
    assert got["s0"]["value_proxy"] == pytest.approx(0.9025 / 2)
    assert got["s0"]["return_std"] == pytest.approx(0.9025 / 2)
    assert (got["s0"]["return_min"], got["s0"]["return_max"]) == pytest.approx((0.0, 0.9025))
    assert got["s1"]["value_proxy"] == pytest.approx(0.475)
    assert got["s2"]["value_proxy"] == pytest.approx(1.0) and got["s2"]["visits"] == 1
    assert got["s3"]["value_proxy"] == 0.0


def test_gamma_changes_the_fallback(known_store):
    connection = sql.open_store_db(known_store, gamma=0.5)
    got = rows(connection, "SELECT value_proxy FROM state_pools WHERE state_key = 's0'")
    assert got == [{"value_proxy": pytest.approx(0.125)}]
    with pytest.raises(GagpoError, match="gamma"):
        sql.open_store_db(known_store, gamma=1.5)


def test_step_returns(con):
    got = rows(
        con, "SELECT step, return, gamma FROM step_returns WHERE traj_id = 'a0' ORDER BY step"
    )
    assert [r["return"] for r in got] == pytest.approx([0.9025, 0.95, 1.0])
    assert got[0]["gamma"] == 0.95


def test_policy_versions(con):
    got = rows(con, "SELECT * FROM policy_versions ORDER BY version")
    keys = ["version", "published", "stored", "pruned", "is_latest", "steps", "trajectories"]
    summary = [tuple(r[k] for k in [*keys, "groups"]) for r in got]
    assert summary == [
        (0, True, False, True, False, 7, 2, 1),  # published, then pruned: its folder is gone
        (1, True, True, False, True, 5, 2, 1),
        (2, False, False, False, False, 0, 0, 0),  # an incomplete folder LATEST has not reached
    ]
    assert got[1]["success_rate"] == 1.0 and got[0]["mean_return"] == 0.5


def test_published_means_latest_reached_it_or_the_stored_base(tmp_path):
    """Before the learner publishes, the actors' v0 is published (they never move LATEST);
    a complete folder beyond LATEST (killed before LATEST moved) is stored, not published;
    pruned versions stay published."""
    store = Store(str(tmp_path / "store"))
    for version in (0, 1):
        store.commit_bytes(store.path("policy", f"v{version}", COMPLETE), b"{}")

    def versions() -> list[tuple]:
        connection = sql.open_store_db(store)
        try:
            got = rows(connection, "SELECT * FROM policy_versions ORDER BY version")
        finally:
            sql.close_store_db(connection)
        return [
            tuple(r[k] for k in ("version", "published", "stored", "pruned", "is_latest"))
            for r in got
        ]

    assert versions() == [(0, True, True, False, False), (1, False, True, False, False)]
    for version in (2, 3):
        store.commit_bytes(store.path("policy", f"v{version}", COMPLETE), b"{}")
    store.policies.set_latest(3)
    store.fs.rm(store.policies.dir(1), recursive=True)  # pruned
    assert versions() == [
        (0, True, True, False, False),
        (1, True, False, True, False),
        (2, True, True, False, False),
        (3, True, True, False, True),
    ]


def test_learner_metrics_empty_but_typed(con):
    assert [n for n, _ in sql.view_columns(con, "learner_metrics")] == list(
        C.LEARNER_METRICS_COLUMNS
    )
    assert rows(con, "SELECT count(*) AS n FROM learner_metrics") == [{"n": 0}]


def test_learner_metrics_read_with_missing_columns_as_null(known_store):
    metrics = pa.table(
        {"update": [1, 2], "version": [1, 2], "loss": [0.5, 0.25], "extra": ["x", "y"]}
    )
    known_store.write_parquet(metrics, known_store.path("learner", "metrics", "000.parquet"), {})
    connection = sql.open_store_db(known_store)
    got = rows(connection, 'SELECT * FROM learner_metrics ORDER BY "update"')
    assert [(r["update"], r["version"], r["loss"], r["approx_kl"]) for r in got] == [
        (1, 1, 0.5, None),
        (2, 2, 0.25, None),
    ]
    assert got[0]["extra"] == "x"  # columns beyond the known ones pass through


def test_learner_histograms(known_store):
    connection = sql.open_store_db(known_store)
    assert rows(connection, "SELECT count(*) AS n FROM learner_histograms") == [{"n": 0}]
    write_histograms(known_store)
    connection = sql.open_store_db(known_store)
    got = rows(
        connection,
        'SELECT name, "update", bin, low, high, count FROM learner_histograms '
        "WHERE name = 'staleness' AND \"update\" = 2 ORDER BY bin",
    )
    assert [(r["bin"], r["low"], r["high"], r["count"]) for r in got] == [
        (0, 0.0, None, 2),
        (1, 1.0, None, 1),
        (2, 2.0, None, 1),
    ]
    got = rows(
        connection,
        "SELECT bin, low, high, sum(count) AS n FROM learner_histograms "
        "WHERE name = 'behavior_weight' GROUP BY ALL ORDER BY bin",
    )
    assert [(r["low"], r["high"], r["n"]) for r in got] == [(0.0, 2.0, 8), (2.0, 4.0, 4)]


def test_heldout_view_reads_the_runs_evaluation(known_store):
    import pyarrow as pa

    from gagpo.schemas import columns as C
    from gagpo.schemas.layout import EVAL, HELDOUT

    assert rows(sql.open_store_db(known_store), "SELECT * FROM heldout") == []
    table = pa.Table.from_pylist(
        [
            {
                "policy_version": v,
                "rollouts": 8,
                "success_rate": s,
                "valid_rate": 1.0,
                "mean_return": 2.0 * s,
                "task_seed": 9,
            }
            for v, s in ((10, 0.5), (0, 0.25))
        ],
        schema=C.HELDOUT_SCHEMA,
    )
    known_store.write_parquet(table, known_store.path(EVAL, HELDOUT), {b"gagpo.eval": b"test"})
    got = rows(sql.open_store_db(known_store), "SELECT policy_version, success_rate FROM heldout")
    assert got == [
        {"policy_version": 0, "success_rate": 0.25},
        {"policy_version": 10, "success_rate": 0.5},
    ]


def test_empty_store_views_work(store_dir):
    connection = sql.open_store_db(str(store_dir))
    for view in sql.VIEWS:
        assert rows(connection, f"SELECT count(*) AS n FROM {view}") == [{"n": 0}]


def test_missing_store_is_a_clear_error(tmp_path):
    with pytest.raises(GagpoError, match="does not exist"):
        sql.open_store_db(str(tmp_path / "nowhere"))


def test_query_errors_are_one_line(con):
    with pytest.raises(GagpoError, match=r"^query failed: .*nope") as info:
        sql.run_query(con, "SELECT * FROM nope")
    assert "\n" not in str(info.value)


# --- return-to-go stays exact for long rollouts --------------------------------------
def reference_returns(rewards: list[float], gamma: float) -> list[float]:
    out, acc = [0.0] * len(rewards), 0.0
    for t in range(len(rewards) - 1, -1, -1):
        acc = rewards[t] + gamma * acc
        out[t] = acc
    return out


def store_with_rollout(root: Path, rewards: list[float]) -> Store:
    table = make_steps(groups=1, group_size=1, lengths=[len(rewards)])
    table = table.set_column(
        table.schema.get_field_index(C.REWARD), C.REWARD, pa.array(rewards, pa.float32())
    )
    store = Store(str(root))
    store.write_shard(table, group_size=1)
    return store


@pytest.mark.parametrize("gamma", [0.5, 0.95, 0.999])
def test_step_returns_exact_for_a_long_rollout(tmp_path, gamma):
    import random

    rng = random.Random(7)
    rewards = [float(pa.scalar(rng.uniform(-1, 1), pa.float32()).as_py()) for _ in range(20_000)]
    store = store_with_rollout(tmp_path / "store", rewards)
    connection = sql.open_store_db(store, gamma=gamma)
    got = [r["return"] for r in rows(connection, "SELECT return FROM step_returns ORDER BY step")]
    want = reference_returns(rewards, gamma)
    assert max(abs(g - w) for g, w in zip(got, want, strict=True)) < 1e-9


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    rewards=st.lists(st.sampled_from([-1.0, -0.5, 0.0, 0.25, 1.0, 3.0]), min_size=1, max_size=30),
    gamma=st.sampled_from([0.0, 0.3, 0.9, 1.0]),
)
def test_step_returns_match_reference(tmp_path_factory, rewards, gamma):
    store = store_with_rollout(tmp_path_factory.mktemp("s") / "store", rewards)
    connection = sql.open_store_db(store, gamma=gamma)
    got = [r["return"] for r in rows(connection, "SELECT return FROM step_returns ORDER BY step")]
    assert got == pytest.approx(reference_returns(rewards, gamma), abs=1e-12)


# --- confinement ---------------------------------------------------------------------
@pytest.fixture
def outside(tmp_path) -> Path:
    folder = tmp_path / "outside"
    folder.mkdir()
    pq.write_table(pa.table({"secret": [42]}), folder / "secret.parquet")
    (folder / "secret.csv").write_text("secret\n42\n")
    return folder


REFUSED = [
    "COPY (SELECT 1 AS x) TO '{outside}/leak.csv'",
    "COPY steps TO '{store}/leak.parquet' (FORMAT parquet)",
    "EXPORT DATABASE '{outside}/export'",
    "ATTACH '{outside}/other.duckdb' AS other",
    "INSTALL httpfs",
    "LOAD httpfs",
    "SELECT * FROM read_parquet('{outside}/secret.parquet')",
    "SELECT * FROM read_csv('{outside}/secret.csv')",
    "SELECT * FROM '{outside}/secret.csv'",
    "SELECT * FROM read_text('/etc/hostname')",
    "SELECT * FROM glob('{outside}/*')",
    "SELECT * FROM read_parquet('{store}/shards/*/*.parquet')",  # files only via the views
    "SET enable_external_access = true",
    "RESET lock_configuration",
]


@pytest.mark.parametrize("template", REFUSED)
def test_writes_and_outside_reads_are_refused(con, known_store, outside, template):
    before = (
        sorted(p.name for p in outside.iterdir()),
        sorted(known_store.fs.find(known_store.root)),
    )
    query = template.format(outside=outside, store=known_store.root)
    with pytest.raises(GagpoError, match=r"^query refused: gagpo sql is read-only") as info:
        sql.run_query(con, query)
    assert "\n" not in str(info.value)
    after = sorted(p.name for p in outside.iterdir()), sorted(known_store.fs.find(known_store.root))
    assert after == before
    # The connection still answers afterwards.
    assert rows(con, "SELECT count(*) AS n FROM steps") == [{"n": 12}]


def test_python_objects_are_not_scanned(con):
    secret = pa.table({"x": [1]})  # noqa: F841  (what a replacement scan would find)
    with pytest.raises(GagpoError, match="query failed"):
        sql.run_query(con, "SELECT * FROM secret")


def test_cli_refusal_is_one_line_and_exit_2(known_store, outside):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "gagpo.inspection.cli",
            "sql",
            "--store",
            known_store.root,
            f"COPY (SELECT 1) TO '{outside}/leak.csv'",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gagpo: error: query refused")
    assert not (outside / "leak.csv").exists()


# --- CLI output ----------------------------------------------------------------------
def invoke(*args: str, input: str | None = None):
    return CliRunner().invoke(inspect, list(args), input=input, catch_exceptions=False)


def test_cli_formats(known_store, tmp_path):
    query = "SELECT traj_id, return, success FROM trajectories ORDER BY traj_id"
    store = known_store.root
    table = invoke("sql", "--store", store, query)
    assert table.exit_code == 0 and "traj_id" in table.output and "(4 rows)" in table.output
    csv = invoke("sql", "--store", store, query, "--format", "csv")
    assert csv.output.splitlines()[0] == '"traj_id","return","success"'
    assert csv.output.splitlines()[1] == '"a0",1,true'
    as_json = json.loads(invoke("sql", "--store", store, query, "--format", "json").output)
    assert as_json[1] == {"traj_id": "a1", "return": 0.0, "success": False}
    out = tmp_path / "result.parquet"
    invoke("sql", "--store", store, query, "--format", "parquet", "--out", str(out))
    assert pq.read_table(out).num_rows == 4
    lists = invoke(
        "sql", "--store", store, "SELECT action_ids FROM steps LIMIT 1", "--format", "csv"
    )
    assert lists.output.splitlines()[1] == '"[3]"'


def test_cli_parquet_needs_out(known_store):
    with pytest.raises(GagpoError, match="--out"):
        invoke("sql", "--store", known_store.root, "SELECT 1", "--format", "parquet")


def test_cli_interactive(known_store, outside):
    script = (
        "SELECT count(*) AS n\n  FROM steps;\n"
        ".views\n"
        f"COPY steps TO '{outside}/x.csv';\n"
        "SELECT 41 + 1 AS answer;\n"
        ".quit\n"
        "SELECT 'never run';\n"
    )
    result = CliRunner().invoke(inspect, ["sql", "--store", known_store.root], input=script)
    assert result.exit_code == 0
    assert "12" in result.output and "42" in result.output
    assert "state_pools:" in result.output and "never run" not in result.output
    assert "query refused" in result.output  # stderr is mixed in by CliRunner
    assert not (outside / "x.csv").exists()


def test_help_is_light():
    code = (
        "import sys\n"
        "from gagpo.inspection.cli import inspect\n"
        "for cmd in (['sql', '--help'], ['report', '--help']):\n"
        "    try:\n"
        "        inspect.main(cmd, standalone_mode=False)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print([m for m in ('duckdb', 'matplotlib', 'torch') if m in sys.modules])\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


# --- object stores: the same views through fsspec ------------------------------------
def test_views_on_an_s3_store(s3_endpoint, tmp_path):
    store = Store(
        f"s3://gagpo/{tmp_path.name}-inspect",
        client_kwargs={"endpoint_url": s3_endpoint},
        skip_instance_cache=True,
    )
    build_known_store(store)
    connection = sql.open_store_db(store)
    assert rows(connection, "SELECT count(*) AS n FROM steps") == [{"n": 12}]
    got = rows(connection, "SELECT version, published FROM policy_versions ORDER BY version")
    assert [(r["version"], r["published"]) for r in got] == [(0, True), (1, True), (2, False)]
    assert rows(connection, "SELECT count(*) AS n FROM advantages") == [{"n": 10}]


# --- docs/inspect.md: every SQL block runs -------------------------------------------
def doc_queries() -> list[str]:
    return re.findall(r"```sql\n(.*?)```", DOCS.read_text(encoding="utf-8"), flags=re.S)


def doc_queries_under(heading: str) -> list[str]:
    """The SQL blocks of the docs section whose `###` heading starts with `heading`."""
    sections = re.split(r"^### ", DOCS.read_text(encoding="utf-8"), flags=re.M)
    section = next(s for s in sections if s.startswith(heading))
    return re.findall(r"```sql\n(.*?)```", section, flags=re.S)


# (columns, rows) of each SQL block of the docs, in their order, on the known store
DOC_ANSWERS = [
    (4, 2),
    (9, 5),
    (5, 1),
    (8, 4),
    (12, 3),
    (5, 2),
    (3, 2),
    (5, 1),  # prompt drift and window slides per run of the known store
    (6, 8),
    (9, 6),
    (9, 3),
    (7, 2),
    (10, 0),
    (2, 0),
]


def test_docs_have_queries():
    assert len(doc_queries()) == len(DOC_ANSWERS)


def test_docs_answers_on_the_known_store(con):
    (most_credit,) = doc_queries_under("Which actions got the most credit")
    got = rows(con, most_credit)
    assert len(got) == 5
    assert (got[0]["traj_id"], got[0]["step"], got[0]["advantage"]) == ("b0", 0, 0.5)

    per_state, per_action = doc_queries_under("Where do GAGPO and GiGPO disagree")
    got = rows(con, per_state)
    assert [(r["group_id"], r["state_key"]) for r in got] == [("gB", "h1")]
    assert got[0]["gagpo_advantage"] == pytest.approx(-0.2)
    assert got[0]["gigpo_advantage"] == pytest.approx(0.2)
    got = rows(con, per_action)
    assert {(r["traj_id"], r["step"]) for r in got} == {("b0", 0), ("b0", 1), ("b1", 0), ("b1", 2)}

    (flow,) = doc_queries_under("How does credit flow back")
    got = rows(con, flow)
    assert [r["step"] for r in got] == [0, 1, 2]  # b1, the longest successful rollout
    assert got[0]["td_to_go"] == pytest.approx(-0.057) and got[2]["td_to_go"] == 0.0

    per_env = doc_queries_under("Singleton-state rate per environment")[0]
    got = {r["env"]: r["singleton_rate"] for r in rows(con, per_env)}
    assert got == {"grid": pytest.approx(3 / 7), "house": 0.0}


@pytest.mark.parametrize("index", range(len(DOC_ANSWERS) if DOCS.exists() else 0))
def test_docs_queries_run(con, index):
    query = doc_queries()[index]
    result = sql.run_query(con, query)
    assert (result.num_columns, result.num_rows) == DOC_ANSWERS[index], query


# --- with the advantage stage, when it is there --------------------------------------
def test_views_over_computed_advantages(tmp_path):
    """Advantages from the Polars stage read back through the views, and the SQL
    return-to-go agrees with the stage's."""
    advantages = pytest.importorskip("gagpo.pipeline.advantages")
    config_module = pytest.importorskip("gagpo.pipeline.config")
    import polars as pl

    store = Store(str(tmp_path / "store"))
    for shard in ("x1", "x2"):
        store.write_shard(make_steps(shard_id=shard, groups=2, group_size=3), group_size=3)
    for name in ("gagpo", "gigpo"):
        config = config_module.parse_estimator_config({"estimator": name, "gamma": 0.9})
        for ref in store.list_shards():
            steps = pl.from_arrow(store.read_shard(ref)).lazy()
            table = advantages.compute_advantages(steps, config).collect().to_arrow()
            metadata = {
                C.META_ESTIMATOR: name.encode(),
                C.META_ESTIMATOR_PARAMS: config.params_json().encode(),
            }
            store.write_parquet(table, store.advantages_path(config.tag, ref.shard_id), metadata)

    connection = sql.open_store_db(store, gamma=0.9)
    got = rows(connection, "SELECT name, shards FROM estimators ORDER BY name")
    assert got == [{"name": "gagpo", "shards": 2}, {"name": "gigpo", "shards": 2}]
    (check,) = rows(
        connection,
        """
        SELECT count(*) AS n,
               max(abs(a.return - r.return)) AS return_gap,
               max(abs(a.value_proxy - p.value_proxy)) AS proxy_gap,
               bool_and(a.state_group_size = p.visits) AS sizes_agree
        FROM advantages a
        JOIN step_returns r USING (traj_id, step)
        JOIN state_pools p ON p.estimator = a.estimator AND p.group_id = a.group_id
             AND p.state_key = a.state_key
        """,
    )
    assert check["n"] == 2 * rows(connection, "SELECT count(*) AS n FROM steps")[0]["n"]
    assert check["return_gap"] < 1e-9 and check["proxy_gap"] < 1e-9 and check["sizes_agree"]
    assert rows(connection, "SELECT count(*) AS n FROM state_pools WHERE estimator IS NULL") == [
        {"n": 0}
    ]


def test_no_torch_in_the_pipeline(known_store):
    code = (
        "import sys\n"
        "from gagpo.inspection.sql import open_store_db, run_query\n"
        f"con = open_store_db({known_store.root!r})\n"
        "run_query(con, 'SELECT * FROM state_pools')\n"
        "print('torch' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


# --- bounds (issue 14, case 6): time, memory, result size, spill folder --------------
def _sql_cli(store: Store, *args: str, cwd=None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "gagpo.inspection.cli", "sql", "--store", store.root, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=cwd)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("--timeout", "1", "select count(*) from range(10000000000000)"), "time limit of 1s"),
        (("--memory-limit", "200MB", "select list(i) from range(3000000000) t(i)"), "memory limit"),
        (("--memory-limit", "16MB", "select * from range(10000000)"), "result exceeds"),
        (("--memory-limit", "lots", "select 1"), "accepted: a positive size"),
    ],
)
def test_cli_limits_stop_a_query_with_one_line(known_store, tmp_path, args, words):
    """The issue's unbounded queries end in seconds, with one line and exit 2; nothing is
    spilled into the current directory."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    done = _sql_cli(known_store, *args, cwd=cwd)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], done.stderr
    assert list(cwd.iterdir()) == []


def test_spill_folder_is_private_and_removed(known_store, tmp_path):
    import os
    import tempfile

    con = sql.open_store_db(known_store, limits=sql.Limits(memory_limit="64MB"))
    ((spill,),) = con.execute("select current_setting('temp_directory')").fetchall()
    assert Path(spill).parent == Path(tempfile.gettempdir()) and Path(spill).is_dir()
    assert os.stat(spill).st_mode & 0o077 == 0  # private to this user
    assert con.execute("select current_setting('memory_limit')").fetchall()[0][0].startswith("61")
    # A sort bigger than the memory limit spills there, and only there.
    table = sql.run_query(
        con,
        "select i from range(20000000) t(i) order by i desc limit 3",
        sql.Limits(memory_limit="64MB"),
    )
    assert table.column(0).to_pylist() == [19999999, 19999998, 19999997]
    with pytest.raises(GagpoError, match="query refused"):  # the query cannot move it
        sql.run_query(con, f"SET temp_directory = '{tmp_path / 'elsewhere'}'")
    sql.close_store_db(con)
    assert not Path(spill).exists() and not (tmp_path / "elsewhere").exists()
    assert not any(Path(known_store.root).rglob("*.tmp"))


def test_time_limit_interrupts_and_the_connection_lives_on(con):
    with pytest.raises(GagpoError, match=r"time limit of 0\.5s"):
        sql.run_query(con, "select count(*) from range(10000000000000)", sql.Limits(timeout_s=0.5))
    assert sql.run_query(con, "select 42 as x").column("x").to_pylist() == [42]


def test_parameters_are_values_never_sql(con, tmp_path):
    """`run_query(..., params=…)` binds values as a prepared statement does; the file and
    time bounds hold with them."""
    hostile = "a0' OR '1'='1"
    assert sql.run_query(
        con, "SELECT count(*) AS n FROM steps WHERE traj_id = ?", params=[hostile]
    ).column("n").to_pylist() == [0]
    named = sql.run_query(
        con, "SELECT count(*) AS n FROM steps WHERE traj_id = $t", params={"t": "a0"}
    )
    expected = rows(con, "SELECT count(*) AS n FROM steps WHERE traj_id = 'a0'")[0]["n"]
    assert named.column("n").to_pylist() == [expected] and expected > 0
    listed = sql.run_query(
        con, "SELECT count(*) AS n FROM steps WHERE traj_id = ANY(?)", params=[["a0", "b0"]]
    )
    assert listed.column("n")[0].as_py() > 0
    target = tmp_path / "out.csv"
    with pytest.raises(GagpoError, match="query refused"):
        sql.run_query(con, "COPY (SELECT ? AS x) TO '" + str(target) + "'", params=[1])
    assert not target.exists()
    with pytest.raises(GagpoError, match=r"time limit of 0\.5s"):
        sql.run_query(
            con,
            "select count(*) from range(?)",
            sql.Limits(timeout_s=0.5),
            params=[10_000_000_000_000],
        )
    with pytest.raises(GagpoError, match="query failed"):
        sql.run_query(con, "SELECT ? AS x")  # a placeholder without its value: one line
