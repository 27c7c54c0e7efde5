"""`gagpo sql` and `gagpo report` on the inputs of issue 21 (items 5-7): an unreadable
shard no learner has quarantined yet, a symlink in shards/ to a file outside the store,
a store that does not exist, an empty query, and the command lines that crashed."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from gagpo.inspection.sql import close_store_db, open_store_db, run_query
from gagpo.storage.store import Store
from tests.helpers.steps import make_steps

ROOT = Path(__file__).resolve().parents[1]
COUNT = "SELECT count(DISTINCT group_id) AS n FROM steps"


def count_groups(store: Store) -> int:
    con = open_store_db(store)
    try:
        return run_query(con, COUNT).column("n")[0].as_py()
    finally:
        close_store_db(con)


def test_an_unreadable_shard_is_skipped_with_one_warning_line(tmp_path, capsys):
    store = Store(str(tmp_path / "store"))
    store.write_shard(make_steps(shard_id="a"), group_size=3)
    bad = store.shard_path("run1", "b")
    Path(bad).write_bytes(b"PAR1 this is not a parquet file")
    assert count_groups(store) == 2  # formerly: every steps query failed
    lines = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(lines) == 1 and "skipped 1 unreadable file(s): shards/run=run1/b.parquet" in lines[0]


def test_a_shard_with_wrong_column_types_is_skipped(tmp_path, capsys):
    import pyarrow as pa

    from gagpo.schemas import columns as C

    store = Store(str(tmp_path / "store"))
    store.write_shard(make_steps(shard_id="a"), group_size=3)
    table = make_steps(shard_id="b")
    i = table.schema.get_field_index(C.STEP)
    table = table.set_column(
        i, C.STEP, pa.array([str(v) for v in table.column(C.STEP).to_pylist()])
    )
    store.write_parquet(table, store.shard_path("run1", "b"), {})
    assert count_groups(store) == 2
    assert "column step has type string" in capsys.readouterr().err


def test_a_symlink_to_a_file_outside_the_store_is_never_read(tmp_path):
    store = Store(str(tmp_path / "store"))
    store.write_shard(make_steps(shard_id="a"), group_size=3)
    outside = Store(str(tmp_path / "elsewhere"))
    outside.write_shard(make_steps(shard_id="x", run_id="run1"), group_size=3)
    os.symlink(outside.shard_path("run1", "x"), store.shard_path("run1", "x"))
    os.symlink(
        tmp_path / "elsewhere" / "shards" / "run=run1", tmp_path / "store" / "shards" / "run=l"
    )
    assert count_groups(store) == 2  # a-g0, a-g1: nothing of the other store


def gagpo(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gagpo.inspection.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


def one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    [line] = [line for line in result.stderr.splitlines() if "error" in line]
    return line


@pytest.mark.parametrize("query", ["", "  ;  "])
def test_sql_empty_query_exits_2(tmp_path, query):
    Store(str(tmp_path / "store")).write_shard(make_steps(), group_size=3)
    assert "the query is empty" in one_error_line(
        gagpo("sql", "--store", str(tmp_path / "store"), query)
    )


def test_sql_on_a_missing_store_exits_2():
    line = one_error_line(gagpo("sql", "--store", "/nonexistent", "select 1"))
    assert "does not exist" in line


@pytest.mark.parametrize("kind", ["missing", "empty"])
def test_report_on_a_missing_or_empty_store_exits_2_and_writes_nothing(tmp_path, kind):
    store = tmp_path / "store"
    if kind == "empty":
        store.mkdir()
    out = tmp_path / "report"
    line = one_error_line(gagpo("report", "--store", str(store), "--out", str(out)))
    assert ("does not exist" if kind == "missing" else "holds no GAGPO data") in line
    assert not out.exists()


def _dead_endpoint() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.mark.parametrize("command", ["actors", "learner"])
def test_store_url_without_a_bucket_is_one_line(command, tmp_path):
    """`--store s3://` crashed in the error handler itself (IndexError on an empty message)."""
    module = {"actors": "gagpo.actors.cli", "learner": "gagpo.learner.cli"}[command]
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_ENDPOINT_URL": _dead_endpoint(),
        "AWS_MAX_ATTEMPTS": "1",
        "GAGPO_STORE_RETRY_S": "1",
    }
    result = subprocess.run(
        [sys.executable, "-m", module, "--store", "s3://", "--policy", "tiny", "--quiet"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )
    assert "IndexError" not in result.stderr
    one_error_line(result)


def test_first_line_of_an_exception_without_a_message():
    from gagpo.schemas.errors import describe, first_line

    assert first_line(OSError()) == "OSError" and describe(ValueError()) == "ValueError"


@pytest.mark.parametrize("module", ["gagpo.actors.cli", "gagpo.learner.cli"])
def test_binary_config_file_is_one_line(tmp_path, module):
    config = tmp_path / "config.toml"
    config.write_bytes(bytes(range(256)) * 4)
    result = subprocess.run(
        [sys.executable, "-m", module, "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    line = one_error_line(result)
    assert str(config) in line and "UTF-8" in line
