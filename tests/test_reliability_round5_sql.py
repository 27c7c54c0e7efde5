"""Issue 39 (reliability round 5), the SQL, view and CLI probes: read-only SQL stays
read-only however a write is spelled (DuckDB's parser, then DuckDB's own file access),
the view answers its own pages only, and bad option values are one line."""

from __future__ import annotations

import contextlib
import hashlib
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from gagpo.inspection import sql
from gagpo.inspection.sql_segments import ReadOnlySegments, segment_url
from gagpo.inspection.view.app import create_app
from gagpo.inspection.view.data import StoreSession
from gagpo.schemas.cli import run_cli
from gagpo.schemas.errors import GagpoError
from gagpo.storage.archive import read_manifest, segment_path
from gagpo.storage.store import Store
from gagpo.workflows import cli
from tests.helpers.sql import compacted_store

GAGPO = [sys.executable, "-m", "gagpo.workflows.cli"]
ORIGIN = "http://127.0.0.1:8765"  # the test client's own origin


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Store:
    return compacted_store(tmp_path_factory.mktemp("round5") / "store")


@pytest.fixture()
def segment(store: Store):
    """The archive's one segment: its path, and a check that it is byte-identical."""
    (entry,) = read_manifest(store).segments
    path = Path(segment_path(store, entry.id))
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    listing = sorted(p.name for p in path.parent.iterdir())
    yield path
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest, "the segment was written"
    assert sorted(p.name for p in path.parent.iterdir()) == listing, "its folder changed"


def gagpo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*GAGPO, *args], capture_output=True, text=True, timeout=300)


def gagpo_here(capsys, monkeypatch, *args: str) -> tuple[int, str, str]:
    """`gagpo ARGS` in this process (as its entry point runs it): exit code, out, err."""
    monkeypatch.setattr(sys, "argv", ["gagpo", *args])
    capsys.readouterr()
    try:
        run_cli(cli.gagpo, prog_name="gagpo")
        code = 0
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def prepared_copy(target: str) -> str:
    return (
        f"PREPARE p AS COPY (SELECT 'x' AS a) TO '{target}' (FORMAT csv, USE_TMP_FILE false); "
        "EXECUTE p"
    )


# --- SQL: no write, however spelled ----------------------------------------------------


def test_prepared_copy_over_a_segment_is_refused_by_gagpo_sql(store, segment):
    result = gagpo("sql", "--store", store.root, prepared_copy(str(segment)))
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("gagpo: error: query refused: gagpo sql is read-only")
    after = gagpo(
        "sql", "--store", store.root, "SELECT count(*) AS n FROM steps", "--format", "csv"
    )
    assert after.returncode == 0, after.stderr


WRITES = [
    prepared_copy("{target}"),
    "PREPARE p AS SELECT 1",  # refused whatever it prepares: values are bound by params
    "EXECUTE p",
    "EXPLAIN ANALYZE COPY (SELECT 'x' AS a) TO '{target}' (FORMAT csv, USE_TMP_FILE false)",
    "EXPLAIN /* a comment */ ANALYZE COPY (SELECT 1 AS a) TO '{target}'",
    "COPY (SELECT 'x' AS a) TO '{target}' (FORMAT csv, USE_TMP_FILE false)",
    "ATTACH '{target}' AS d (READ_WRITE); CREATE TABLE d.t AS SELECT 1 AS x; CHECKPOINT d",
    "EXPORT DATABASE '{folder}'",
    "INSTALL httpfs",
    "LOAD httpfs",
    "CALL enable_logging(storage = 'file', storage_path = '{folder}')",
    "SET log_query_path = '{target}'",
    "PRAGMA enable_profiling = 'json'; PRAGMA profiling_output = '{target}'",
]
TARGETS = {
    "path": lambda p: str(p),
    "url": lambda p: segment_url(str(p)),
    "file-url": lambda p: f"file://{p}",
}


def spelled(template: str, path: Path, target: str) -> str:
    folder = target[: -len(path.name) - 1]
    return template.format(target=target, folder=folder)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("template", WRITES)
def test_no_spelling_of_a_write_reaches_a_segment(store, segment, template, target):
    con = sql.open_store_db(store)
    try:
        with pytest.raises(GagpoError, match=r"^query refused: gagpo sql is read-only"):
            sql.run_query(con, spelled(template, segment, TARGETS[target](segment)))
    finally:
        sql.close_store_db(con)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize(
    "template", [w for w in WRITES if w not in ("PREPARE p AS SELECT 1", "EXECUTE p")]
)
def test_duckdb_itself_refuses_the_writes_the_parser_check_would_miss(
    store, segment, template, target, monkeypatch
):
    """Without the statement check, DuckDB's file access alone: the segment is readable
    through a file system that has no writes, and no other file is allowed (the `segment`
    fixture checks it byte-identical)."""
    monkeypatch.setattr(sql, "_refuse_statements", lambda query: None)
    con = sql.open_store_db(store)
    try:
        query = spelled(template, segment, TARGETS[target](segment))
        if template.startswith("ATTACH"):  # DuckDB attaches a Parquet file's rows in memory
            with contextlib.suppress(GagpoError):
                sql.run_query(con, query)
        else:
            with pytest.raises(GagpoError, match=r"^query (refused|failed): "):
                sql.run_query(con, query)
        rows = sql.run_query(
            con, f"SELECT count(*) AS n FROM read_parquet('{segment_url(str(segment))}')"
        )
        assert rows["n"].to_pylist() == [read_manifest(store).segments[0].rows]
    finally:
        sql.close_store_db(con)


def test_reads_and_explains_still_run(store, segment):
    con = sql.open_store_db(store)
    try:
        n = sql.run_query(con, "SELECT count(*) AS n FROM steps")["n"].to_pylist()[0]
        assert n == sum(store.read_table(p).num_rows for p in sql.src.steps_files(store))
        for explain in (
            "EXPLAIN ANALYZE SELECT count(*) FROM steps",
            "EXPLAIN/* a */ANALYZE -- b\n(FORMAT json) SELECT 1",
            "EXPLAIN SELECT '-- not a comment' AS a",
        ):
            assert sql.run_query(con, explain).num_rows >= 1, explain
        sql.run_query(con, "CREATE TEMP TABLE t AS SELECT 1 AS x")  # in memory: allowed
    finally:
        sql.close_store_db(con)


# --- the view: its own pages only ------------------------------------------------------


@pytest.fixture(scope="module")
def view(store) -> TestClient:
    app = create_app([StoreSession("s", store.root)])
    return TestClient(app, base_url=ORIGIN, raise_server_exceptions=False)


def one_line(response) -> str:
    assert response.text.endswith("\n") and response.text.count("\n") == 1, response.text
    return response.text.strip()


def test_the_view_refuses_a_prepared_copy_over_a_segment(view, segment):
    response = view.post("/api/sql", json={"query": prepared_copy(str(segment))})
    assert response.status_code == 400
    assert one_line(response).startswith("query refused: gagpo sql is read-only")
    csv = view.get("/api/sql.csv", params={"query": prepared_copy(str(segment))})
    assert csv.status_code == 400


def test_a_cross_origin_text_plain_post_runs_nothing(view, segment, monkeypatch):
    ran = []
    monkeypatch.setattr(StoreSession, "fresh_query", lambda *a, **k: ran.append(a))
    body = '{"query": "' + prepared_copy(str(segment)).replace("'", "''") + '"}'
    for headers in (
        {"content-type": "text/plain", "origin": "https://evil.example"},
        {"content-type": "text/plain"},  # a simple request is refused with no Origin too
        {"content-type": "application/x-www-form-urlencoded", "origin": "null"},
    ):
        response = view.post("/api/sql", content=body, headers=headers)
        assert response.status_code == 415, headers
        assert "application/json" in one_line(response)
    assert ran == []


@pytest.mark.parametrize(
    "headers",
    [
        {"origin": "https://evil.example"},
        {"origin": "http://127.0.0.1:9999"},  # another port is another origin
        {"origin": "null"},
        {"origin": "http://127.0.0.1.evil.example:8765"},
        {"sec-fetch-site": "cross-site"},
        {"sec-fetch-site": "same-site"},
        {"origin": ORIGIN, "sec-fetch-site": "cross-site"},
    ],
)
def test_requests_from_another_site_are_refused(view, headers, monkeypatch):
    ran = []
    monkeypatch.setattr(StoreSession, "fresh_query", lambda *a, **k: ran.append(a))
    post = view.post("/api/sql", json={"query": "SELECT 1"}, headers=headers)
    get = view.get("/api/sql.csv", params={"query": "SELECT 1"}, headers=headers)
    data = view.get("/api/run", headers=headers)
    for response in (post, get, data):
        assert response.status_code == 403, (headers, response.text)
        assert one_line(response).startswith("this server answers its own pages only")
    assert ran == []


def test_the_pages_own_requests_and_links_to_it_are_answered(view):
    own = {"origin": ORIGIN, "sec-fetch-site": "same-origin"}
    response = view.post("/api/sql", json={"query": "SELECT 41 + 1 AS x"}, headers=own)
    assert response.status_code == 200 and response.json()["rows"] == [["42"]]
    typed = {"sec-fetch-site": "none"}  # a URL typed in the address bar
    assert (
        view.get("/api/sql.csv", params={"query": "SELECT 1 AS x"}, headers=typed).status_code
        == 200
    )
    link = {"sec-fetch-site": "cross-site"}  # a link to a page from elsewhere opens it
    assert view.get("/sql", headers=link).status_code == 200
    assert view.post("/api/sql", json={"query": "SELECT 1"}).status_code == 200  # curl
    proxied = {"origin": ORIGIN.replace("http:", "https:")}  # behind a proxy that ends TLS
    assert view.post("/api/sql", json={"query": "SELECT 1"}, headers=proxied).status_code == 200


# --- one-line errors for bad option values -----------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["compact", "--segment-mib", "1e12"],
        ["compact", "--segment-mib", "nan"],
        ["compact", "--segment-mib", "inf"],
        ["compact", "--segment-mib", "abc"],
        ["compact", "--segment-mib", "0"],
        ["sql", "--timeout", "nan", "SELECT 1"],
        ["sql", "--timeout", "inf", "SELECT 1"],
        ["sql", "--timeout", "abc", "SELECT 1"],
        ["sql", "--max-rows", "0", "SELECT 1"],
        ["sql", "--format", "xml", "SELECT 1"],
        ["sql", "--gamma", "2", "SELECT 1"],
        ["sql", "--as-of-update", "-1", "SELECT 1"],
        ["report", "--timeout", "-1"],
    ],
)
def test_a_bad_option_value_is_one_line(store, args, capsys, monkeypatch):
    code, _, err = gagpo_here(capsys, monkeypatch, args[0], "--store", store.root, *args[1:])
    assert code == 2
    assert err.count("\n") == 1, err
    assert err.startswith("gagpo: error: "), err
    assert args[1].lstrip("-").replace("-", "_") in err.replace("-", "_")  # names the option


@pytest.mark.parametrize(
    "query",
    ["-- which run?\nSELECT 7 AS x", "--no space\nSELECT 7 AS x", "-- a\n-- b\nSELECT 7 AS x"],
)
def test_a_query_that_starts_with_a_comment_is_a_query(store, query, capsys, monkeypatch):
    for args in ([query, "--format", "csv"], ["--format", "csv", query]):
        code, out, err = gagpo_here(capsys, monkeypatch, "sql", "--store", store.root, *args)
        assert code == 0, err
        assert out.split() == ['"x"', "7"]


def test_a_segment_read_keeps_each_threads_position(segment):
    """DuckDB seeks, then reads, on a handle its threads share: one thread's seek between
    another's seek and read must not move that read (it made scans fail or misread)."""
    whole = segment.read_bytes()
    handle = ReadOnlySegments([str(segment)]).open(segment_url(str(segment)), "rb")
    sought, other_sought = threading.Event(), threading.Event()
    got = {}

    def first() -> None:
        handle.seek(4)
        sought.set()
        other_sought.wait(5)
        got["first"] = handle.read(16)

    def second() -> None:
        sought.wait(5)
        handle.seek(len(whole) - 16)
        other_sought.set()
        got["second"] = handle.read(16)

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    handle.close()
    assert got == {"first": whole[4:20], "second": whole[-16:]}
    with pytest.raises(PermissionError):
        ReadOnlySegments([str(segment)]).open(segment_url(str(segment)), "wb")
    with pytest.raises(PermissionError):  # a file not listed is not opened, even to read
        ReadOnlySegments([]).open(segment_url(str(segment)), "rb")
