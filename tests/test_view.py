"""`gagpo view` without a browser: its refusals, its errors, and that what it shows is what
`gagpo advantages`, `gagpo sql` and the `state_pools` view say."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from click.testing import CliRunner
from starlette.testclient import TestClient

from gagpo.inspection.sql import query_store
from gagpo.inspection.view.access import check_bind, is_loopback
from gagpo.inspection.view.app import create_app
from gagpo.inspection.view.data import StoreSession
from gagpo.schemas.errors import GagpoError
from gagpo.workflows import view as view_cli
from tests.helpers.view import cli_advantages, cli_csv, free_port, raw_get, serving, view_store

__all__ = ["view_store"]  # the fixture, imported for pytest
TOKEN = "t0k3n-for-the-tests-only"


def client(store: Path, **kwargs) -> TestClient:
    app = create_app([StoreSession("s", str(store))], **kwargs)
    return TestClient(app, base_url="http://127.0.0.1:8765", raise_server_exceptions=False)


def one_line(response) -> str:
    text = response.text
    assert text.endswith("\n") and text.count("\n") == 1, text
    assert "Traceback" not in text
    return text.strip()


@pytest.fixture(scope="module")
def app_client(view_store: Path) -> TestClient:
    return client(view_store)


@pytest.fixture(scope="module")
def group_id(view_store: Path) -> str:
    """The group whose rollouts' returns differ most (ties: the smallest id)."""
    return query_store(
        view_store,
        "SELECT group_id FROM groups ORDER BY max_return - min_return DESC, group_id LIMIT 1",
    )["group_id"][0].as_py()


# --- refusals ------------------------------------------------------------------------


def test_a_non_loopback_bind_needs_a_token(view_store: Path):
    for host in ("0.0.0.0", "192.0.2.1", "::", "example.org"):
        assert not is_loopback(host)
        with pytest.raises(GagpoError, match="needs an access token"):
            create_app([StoreSession("s", str(view_store))], host=host)
    for host in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"):
        assert is_loopback(host)
        check_bind(host, None)
    check_bind("0.0.0.0", TOKEN)
    with pytest.raises(GagpoError, match="too short"):
        check_bind("0.0.0.0", "short")


def test_the_cli_generates_a_token_for_another_address(view_store: Path, monkeypatch):
    import uvicorn

    served = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: served.update(app=app, **kw))
    port = free_port()
    result = CliRunner().invoke(
        view_cli.view_command,
        ["--store", str(view_store), "--host", "0.0.0.0", "--port", str(port)],
    )
    assert result.exit_code == 0, result.output
    assert served["host"] == "0.0.0.0" and served["port"] == port
    token = result.output.split("?token=")[1].split()[0]
    assert len(token) >= 16 and "generated" in result.output
    guarded = TestClient(served["app"], base_url="http://192.0.2.7:8765")
    assert guarded.get("/").status_code == 401
    assert guarded.get("/", params={"token": token}).status_code == 200


def test_a_request_without_the_token_is_refused(view_store: Path):
    c = client(view_store, host="0.0.0.0", token=TOKEN)
    for path in ("/", "/group", "/api/stores", "/api/run", "/static/common.js", "/nope"):
        response = c.get(path)
        assert response.status_code == 401, path
        assert "access token" in one_line(response)
    assert c.get("/api/stores", params={"token": "wrong-token-of-some-length"}).status_code == 401
    assert c.get("/api/stores", headers={"authorization": f"Bearer {TOKEN}"}).status_code == 200
    first = c.get("/", params={"token": TOKEN})  # once in the URL, then the cookie
    assert first.status_code == 200 and "HttpOnly" in first.headers["set-cookie"]
    assert c.get("/api/stores").status_code == 200  # the client kept the cookie
    c.cookies.clear()
    assert c.get("/api/stores").status_code == 401


def test_a_foreign_host_name_is_refused_on_loopback(app_client: TestClient):
    """DNS rebinding: a page elsewhere reaching 127.0.0.1 under its own name."""
    response = app_client.get("/api/stores", headers={"host": "attacker.example:8765"})
    assert response.status_code == 403 and "localhost only" in one_line(response)
    for host in ("localhost:9000", "127.0.0.1", "[::1]:8765"):  # a tunnel's local end
        assert app_client.get("/api/stores", headers={"host": host}).status_code == 200


TRAVERSALS = [
    "/../../etc/passwd",
    "/static/../../etc/passwd",
    "/static/..%2f..%2fetc%2fpasswd",
    "/static/%2e%2e/%2e%2e/etc/passwd",
    "/%2e%2e/%2e%2e/etc/passwd",
    "/static/%2e%2e%2fapp.py",
    "/static/..%5c..%5cetc%5cpasswd",
    "/static//etc/passwd",
    "/static/%2fetc%2fpasswd",
    "/static/../app.py",
    "/static/..%252f..%252fetc%252fpasswd",
    "/etc/passwd",
    "/static/run.html%00.js",
    "//etc/passwd",
]


def test_nothing_outside_the_store_is_served(view_store: Path):
    """Byte-exact request targets to a real server: only the app's own routes answer."""
    with serving(create_app([StoreSession("s", str(view_store))])) as base:
        status, body = raw_get(base, "/static/common.js")
        assert status == 200
        for target in TRAVERSALS:
            status, body = raw_get(base, target)
            assert status in (400, 404), (target, status)
            assert "root:" not in body and "import" not in body, target
            assert body.endswith("\n") and body.count("\n") == 1, (target, body)


def test_write_and_file_statements_are_refused(app_client: TestClient, tmp_path: Path):
    target = tmp_path / "out.csv"
    for query in (
        f"COPY steps TO '{target}'",
        f"ATTACH '{tmp_path / 'x.db'}' AS x",
        "INSTALL httpfs",
        "SELECT * FROM read_csv('/etc/passwd')",
        f"EXPORT DATABASE '{tmp_path}'",
        "SET enable_external_access = true",
    ):
        response = app_client.post("/api/sql", json={"query": query})
        assert response.status_code == 400, query
        assert one_line(response).startswith(("query refused", "query failed")), query
    assert not target.exists() and not (tmp_path / "x.db").exists()
    csv = app_client.get("/api/sql.csv", params={"query": f"COPY steps TO '{target}'"})
    assert csv.status_code == 400 and not target.exists()


# --- errors: one line, 4xx -------------------------------------------------------------


def test_a_bad_group_id_is_a_clean_404(app_client: TestClient):
    for path in (
        "/group?group=01nonexistentgroup",
        "/api/group?group=01nonexistentgroup",
        "/compare?group=01nonexistentgroup",
    ):
        response = app_client.get(path)
        assert response.status_code == 404, path
        assert "is not in store" in one_line(response)
    bad = app_client.get("/group", params={"group": "x' OR 1=1 --"})
    assert bad.status_code == 400 and "is not an id" in one_line(bad)


@pytest.mark.parametrize(
    ("path", "status"),
    [
        ("/api/group?group=g&estimator=ppo", 400),
        ("/api/group?group=g&estimator=gagpo&lam=2", 400),
        ("/api/group?group=g&estimator=gagpo&gamma=abc", 400),
        ("/api/group?group=g&estimator=grpo&lam=0.5", 400),
        ("/api/group?group=g&estimator=gagpo&state_grouping=fuzzy", 400),
        ("/api/groups?version=x", 400),
        ("/api/groups?limit=0", 400),
        ("/api/groups?order=up", 400),
        ("/api/run?store=other", 404),
        ("/api/compare?group=g&estimators=", 400),
        ("/nope", 404),
        ("/api/sql", 405),
    ],
)
def test_bad_parameters_are_one_line_4xx(app_client: TestClient, path: str, status: int):
    response = app_client.get(path)
    assert response.status_code == status, response.text
    one_line(response)


def test_bad_sql_is_one_line(app_client: TestClient):
    for body in ({"query": "SELEC 1"}, {"query": ""}, {"nope": 1}):
        response = app_client.post("/api/sql", json=body)
        assert response.status_code == 400
        one_line(response)


# --- what the pages show ---------------------------------------------------------------


def advantages_shown(app_client: TestClient, group_id: str, **params) -> dict[tuple, float]:
    response = app_client.get("/api/group", params={"group": group_id, **params})
    assert response.status_code == 200, response.text
    return {
        (r["traj_id"], s["step"]): s["advantage"]
        for r in response.json()["rollouts"]
        for s in r["steps"]
    }


@pytest.mark.parametrize(
    ("params", "flags"),
    [
        ({"estimator": "grpo"}, ["--estimator", "grpo"]),
        ({"estimator": "gigpo"}, ["--estimator", "gigpo"]),
        (
            {"estimator": "gagpo", "gamma": "0.9", "lam": "0.7"},
            ["--estimator", "gagpo", "--gamma", "0.9", "--lam", "0.7"],
        ),
        (
            {"estimator": "gagpo", "state_grouping": "minhash:0.5"},
            ["--estimator", "gagpo", "--state-grouping", "minhash:0.5"],
        ),
        ({"estimator": "rloo"}, ["--estimator", "rloo"]),
    ],
)
def test_the_group_page_equals_gagpo_advantages(
    app_client, view_store, group_id, tmp_path, params, flags
):
    expected = cli_advantages(view_store, group_id, tmp_path / "adv.parquet", *flags)
    shown = advantages_shown(app_client, group_id, **params)
    assert shown.keys() == expected.keys()
    for key, value in expected.items():
        assert round(shown[key], 4) == pytest.approx(round(value, 4), abs=1e-12), key


def test_the_stored_tag_is_shown_as_stored(app_client, view_store, group_id):
    tag = query_store(view_store, "SELECT estimator FROM estimators")["estimator"][0].as_py()
    stored = query_store(
        view_store,
        f"SELECT traj_id, step, advantage FROM advantages "
        f"WHERE group_id = '{group_id}' AND estimator = '{tag}'",
    ).to_pylist()
    shown = advantages_shown(app_client, group_id, estimator=f"stored:{tag}")
    assert shown == {(r["traj_id"], r["step"]): r["advantage"] for r in stored}


def test_each_pool_equals_the_state_pools_view(app_client, view_store, group_id):
    tag = query_store(view_store, "SELECT estimator FROM estimators")["estimator"][0].as_py()
    view = app_client.get(
        "/api/group", params={"group": group_id, "estimator": f"stored:{tag}"}
    ).json()
    pools = query_store(
        view_store,
        f"""
        SELECT pool_id, any_value(pool_visits) AS visits, any_value(value_proxy) AS value,
               list(state_key ORDER BY state_key) AS states
        FROM state_pools WHERE group_id = '{group_id}' AND estimator = '{tag}' GROUP BY pool_id
    """,
    ).to_pylist()
    steps = query_store(
        view_store, f"SELECT traj_id, step, state_key FROM steps WHERE group_id = '{group_id}'"
    ).to_pylist()
    expected = {p["pool_id"]: p for p in pools}
    assert {p["pool_id"] for p in view["pools"]} == expected.keys()
    for pool in view["pools"]:
        want = expected[pool["pool_id"]]
        assert pool["size"] == want["visits"]
        assert pool["states"] == want["states"]
        assert math.isclose(pool["value_proxy"], want["value"], rel_tol=1e-9, abs_tol=1e-12)
        members = sorted((traj, step) for traj, step, *_ in pool["members"])
        assert members == sorted(
            (s["traj_id"], s["step"]) for s in steps if s["state_key"] in want["states"]
        )


def test_the_sql_csv_equals_gagpo_sql(app_client, view_store):
    query = (
        "SELECT group_id, traj_id, step, reward, won, behavior_logprobs[1:2] AS lp "
        "FROM steps ORDER BY group_id, traj_id, step LIMIT 50"
    )
    response = app_client.get("/api/sql.csv", params={"query": query})
    assert response.status_code == 200
    assert response.text == cli_csv(view_store, query)
    table = app_client.post("/api/sql", json={"query": query}).json()
    assert table["group_column"] and table["total"] == 50


def auc_or_nan(value) -> float:
    return float("nan") if value is None else value


def test_the_compare_page_shows_the_solvers_credit_auc(view_store, group_id, tmp_path):
    """With Sokoban's solver wired in (as `gagpo view` does), the AUC of each estimator and
    the optimal moves are credit.py's, for the group and for one of its rollouts."""
    import polars as pl

    from gagpo.workflows import credit
    from gagpo.workflows.view import EnvironmentOracle

    app = client(view_store, oracle=EnvironmentOracle())
    steps = pl.from_arrow(
        query_store(view_store, f"SELECT * FROM steps WHERE group_id = '{group_id}'")
    )
    labelled = credit.label(steps)
    assert labelled.height and 0 < labelled["optimal"].sum() < labelled.height
    estimators = {"grpo": ["--estimator", "grpo"], "gagpo": ["--estimator", "gagpo"]}
    expected = {}
    for name, flags in estimators.items():
        adv = cli_advantages(view_store, group_id, tmp_path / f"{name}.parquet", *flags)
        expected[name] = pl.DataFrame(
            [(t, s, a) for (t, s), a in adv.items()],
            schema=["traj_id", "step", "advantage"],
            orient="row",
        )
    traj = labelled["traj_id"][0]
    for params, rows in (
        ({}, labelled),
        ({"traj": traj}, labelled.filter(pl.col("traj_id") == traj)),
    ):
        shown = app.get(
            "/api/compare", params={"group": group_id, "estimators": "grpo,gagpo", **params}
        ).json()
        assert shown["oracle"]["name"] == EnvironmentOracle.name
        assert shown["oracle"]["labelled"] == rows.height
        for i, name in enumerate(estimators):
            want = credit.credit_auc(rows.join(expected[name], on=["traj_id", "step"]))
            got = shown["summaries"][i]
            assert got["labelled"] == rows.height
            assert auc_or_nan(got["auc"]) == pytest.approx(want["auc"], abs=1e-9, nan_ok=True)
            assert auc_or_nan(got["state_auc"]) == pytest.approx(
                want["state_auc"], abs=1e-9, nan_ok=True
            )
        marks = {(r["traj_id"], r["step"]): r["optimal"] for r in shown["rows"]}
        if params:  # one rollout: its rows only
            assert {traj_id for traj_id, _ in marks} == {traj}
        want_marks = dict(
            zip(zip(rows["traj_id"], rows["step"], strict=True), rows["optimal"], strict=True)
        )
        assert {k: v for k, v in marks.items() if v is not None} == want_marks
    answer = client(view_store).get("/api/compare", params={"group": group_id}).json()
    assert answer["oracle"] is None and "auc" not in answer["summaries"][0]
    bad = app.get("/api/compare", params={"group": group_id, "traj": "01nonexistenttraj"})
    assert bad.status_code == 404 and "is not in group" in one_line(bad)


def test_the_run_compare_and_pools_data(app_client, group_id):
    run = app_client.get("/api/run").json()
    assert [v["version"] for v in run["versions"]] == [0] and run["versions"][0]["groups"] == 4
    assert run["heldout"] == [] and run["learner"] == []
    groups = app_client.get("/api/groups").json()
    assert len(groups) == 4 and group_id in {g["group_id"] for g in groups}
    assert groups[0]["return_spread"] == max(g["return_spread"] for g in groups)
    compare = app_client.get(
        "/api/compare", params={"group": group_id, "estimators": "grpo,gagpo", "lam": "0.5"}
    ).json()
    assert [e["tag"].split("-")[0] for e in compare["estimators"]] == ["grpo", "gagpo"]
    assert "lam_0.5" in compare["estimators"][1]["tag"]
    assert all(0 <= s["zero_share"] <= 1 and s["iqr"] >= 0 for s in compare["summaries"])
    pools = app_client.get("/api/pools").json()
    assert pools["modes"][0]["state_grouping"] == "exact" and pools["largest"]
    for page in (
        "/",
        "/group",
        f"/group?group={group_id}",
        "/sql",
        "/pools",
        f"/compare?group={group_id}",
    ):
        response = app_client.get(page)
        assert response.status_code == 200 and "<!doctype html>" in response.text
        assert "script-src 'self'" in response.headers["content-security-policy"]


def test_assets_ship_in_the_package_and_name_no_other_host():
    from gagpo.inspection.view.app import load_assets

    assets = load_assets()
    assert {
        "uPlot.iife.min.js",
        "uPlot.min.css",
        "uPlot.LICENSE.txt",
        "common.js",
        "group.js",
        "run.html",
    } <= assets.keys()
    for name, (body, _) in assets.items():
        if name.endswith((".html", ".css")) or name in (
            "common.js",
            "group.js",
            "run.js",
            "sql.js",
            "compare.js",
            "pools.js",
        ):
            assert b"http://" not in body and b"https://" not in body, name


# --- S3 stores work as local ones ------------------------------------------------------


def page_data(session: StoreSession, group_id: str, tag: str) -> dict:
    """What the group, compare and run pages read, without the store's label."""
    from gagpo.inspection.view import data, pools

    shown = {
        "stored": data.group_view(session, group_id, f"stored:{tag}", {}),
        "recomputed": data.group_view(session, group_id, "gigpo", {"gamma": 0.9}),
        "compare": data.compare_view(session, group_id, [("grpo", {}), ("gagpo", {})]),
        "groups": data.group_list(session),
        "run": data.run_data(session),
        "pools": pools.pools_view(session),
    }
    return data.plain(
        {k: {**v, "store": None} if isinstance(v, dict) else v for k, v in shown.items()}
    )


def test_an_s3_store_shows_what_the_local_one_does(s3_endpoint, view_store, group_id, tmp_path):
    """The same store on a moto S3 server, as shards and once compacted: every page reads
    what it reads from the local copy (the group page: that group's rows)."""
    import shutil

    import s3fs

    from gagpo.learner.compact import compact_store
    from gagpo.learner.config import CompactionSettings

    tag = query_store(view_store, "SELECT estimator FROM estimators")["estimator"][0].as_py()
    local_copy = tmp_path / "store"
    shutil.copytree(view_store, local_copy)
    url = f"s3://gagpo/{tmp_path.name}-view"
    s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint}).put(
        str(local_copy), url.removeprefix("s3://"), recursive=True
    )
    for stage in ("shards", "compacted"):
        if stage == "compacted":
            for target in (str(local_copy), url):
                compact_store(target, None, True, CompactionSettings(), echo=lambda line: None)
        local, remote = StoreSession("s", str(local_copy)), StoreSession("s", url)
        try:
            assert page_data(remote, group_id, tag) == page_data(local, group_id, tag), stage
        finally:
            local.close()
            remote.close()
    app = TestClient(create_app([StoreSession("s3", url)]), base_url="http://127.0.0.1:8765")
    assert app.get(f"/group?group={group_id}").status_code == 200
    assert app.get("/group?group=01nonexistentgroup").status_code == 404


def test_the_pools_page_equals_the_state_pools_view(view_store, tmp_path):
    """The pools page counts pools without the `state_pools` view; on a store with an exact
    tag, a minhash tag and a group without advantages, it says what the view says."""
    import shutil

    from gagpo.inspection.view.pools import pools_view
    from tests.helpers.view import GAGPO, run

    store = tmp_path / "store"
    shutil.copytree(view_store, store)
    run([*GAGPO, "advantages", "--store", str(store), "--state-grouping", "minhash:0.3"])
    shard = sorted(store.glob("shards/run=*/*.parquet"))[0].name
    for table in store.glob(f"advantages/*/{shard}"):  # that shard's group: no advantages
        table.unlink()
    view = pools_view(StoreSession("s", str(store)), limit=1000)
    modes = query_store(
        store,
        """
        SELECT estimator, any_value(state_grouping) AS state_grouping,
               count(DISTINCT (group_id, pool_id)) AS pools, sum(visits)::BIGINT AS steps,
               coalesce(sum(visits) FILTER (WHERE pool_visits = 1), 0) / sum(visits)
                   AS singleton_share
        FROM state_pools GROUP BY estimator ORDER BY estimator NULLS LAST""",
    ).to_pylist()
    assert [m["state_grouping"] for m in modes] == ["exact", "minhash:0.3", "exact"]
    assert view["modes"] == modes
    pools = query_store(
        store,
        """
        SELECT estimator, group_id, pool_id, any_value(pool_visits) AS visits,
               any_value(pool_states) AS states, any_value(value_proxy) AS value_proxy
        FROM state_pools GROUP BY estimator, group_id, pool_id
        ORDER BY visits DESC, estimator, group_id, pool_id""",
    ).to_pylist()
    assert len(view["largest"]) == min(1000, len(pools))
    for got, want in zip(view["largest"], pools, strict=False):
        assert {**got, "value_proxy": None} == {**want, "value_proxy": None}
        assert math.isclose(got["value_proxy"], want["value_proxy"], rel_tol=1e-9, abs_tol=1e-12)
    merged = query_store(
        store,
        """
        SELECT estimator, group_id, pool_id, list(state_key ORDER BY state_key) AS states,
               sum(visits)::BIGINT AS visits, any_value(state_grouping) AS state_grouping
        FROM state_pools WHERE pool_states > 1 GROUP BY estimator, group_id, pool_id
        ORDER BY visits DESC, estimator, group_id, pool_id""",
    ).to_pylist()
    assert merged and view["merged"] == merged
    top = pools_view(StoreSession("s", str(store)), limit=3)["largest"]
    assert [p["visits"] for p in top] == [p["visits"] for p in pools[:3]]
