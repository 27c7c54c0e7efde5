"""A small real store and a live `gagpo view` server, shared by tests/test_view*.py.

The store: `gagpo-actors` (sokoban, the tiny policy, 4 groups of 4 rollouts, one shard per
group) and `gagpo advantages --store` (a stored GAGPO tag), built once per session.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import polars as pl
import pytest

GAGPO = [sys.executable, "-m", "gagpo.workflows.cli"]
ACTORS = [sys.executable, "-m", "gagpo.actors.cli", "--quiet"]


def run(args: list[str]) -> subprocess.CompletedProcess:
    result = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    return result


@pytest.fixture(scope="session")
def view_store(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("view") / "store"
    run(
        [
            *ACTORS,
            "--store",
            str(root),
            "--env",
            "sokoban",
            "--policy",
            "tiny",
            "--groups",
            "4",
            "--group-size",
            "4",
            "--max-turns",
            "20",
            "--seed",
            "0",
        ]
    )
    run([*GAGPO, "advantages", "--store", str(root)])
    return root


def shard_of(store: Path, group_id: str) -> Path:
    """The inbox shard holding `group_id` (one group per shard)."""
    for path in sorted(store.glob("shards/run=*/*.parquet")):
        if group_id in pl.read_parquet(path, columns=["group_id"])["group_id"].to_list():
            return path
    raise AssertionError(f"no shard holds {group_id}")


def cli_advantages(store: Path, group_id: str, out: Path, *flags: str) -> dict[tuple, float]:
    """(traj_id, step) → advantage, as `gagpo advantages --input <the group's shard>` writes."""
    run(
        [*GAGPO, "advantages", "--input", str(shard_of(store, group_id)), "--out", str(out), *flags]
    )
    table = pl.read_parquet(out)
    return {(t, s): a for t, s, a in table.select("traj_id", "step", "advantage").iter_rows()}


def cli_csv(store: Path, query: str) -> str:
    return run([*GAGPO, "sql", "--store", str(store), query, "--format", "csv"]).stdout


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def serving(app) -> Iterator[str]:
    """`app` under uvicorn in a thread on a free loopback port; yields its base URL."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def raw_get(base: str, target: str, headers: str = "") -> tuple[int, str]:
    """GET `target` byte for byte (no client normalises `..` or `%2e`); (status, body)."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(
            f"GET {target} HTTP/1.1\r\nHost: {host}:{port}\r\n{headers}"
            "Connection: close\r\n\r\n".encode()
        )
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode("utf-8", "replace")
