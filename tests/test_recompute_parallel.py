"""`gagpo advantages --store S --workers N`: shards recomputed in parallel (processes, or Ray
with --ray) leave the store exactly as the serial run does, byte for byte, with the same
quarantine decisions in the same order, and never more than N shards in flight."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from gagpo.pipeline import parallel
from gagpo.pipeline.advantages import compute_advantages
from gagpo.pipeline.cli import advantages
from gagpo.pipeline.config import parse_estimator_config
from gagpo.pipeline.recompute import _arrow, advantages_metadata, encode_parquet
from gagpo.schemas import columns as C
from gagpo.storage.store import Store
from tests.helpers.procs import processes_naming
from tests.helpers.steps import make_steps

ACTORS = [sys.executable, "-m", "gagpo.actors.cli"]
ADVANTAGE_COLUMNS = [
    "return",
    "value_proxy",
    "next_value_proxy",
    "td_residual",
    "advantage_raw",
    "advantage",
    "state_group_size",
]


@pytest.fixture(scope="module")
def real_store(tmp_path_factory) -> Path:
    """A store the real actor loop wrote: 12 one-group shards of sokoban with the tiny policy."""
    root = tmp_path_factory.mktemp("real") / "store"
    proc = subprocess.run(
        [
            *ACTORS,
            "--env",
            "sokoban",
            "--policy",
            "tiny",
            "--store",
            str(root),
            "--groups",
            "12",
            "--group-size",
            "4",
            "--max-turns",
            "5",
            "--max-new-tokens",
            "3",
            "--groups-per-shard",
            "1",
            "--run-id",
            "real",
            "--seed",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(Store(str(root)).list_shards()) == 12
    return root


def _copy(store: Path, dest: Path) -> Path:
    shutil.copytree(store, dest)
    return dest


def _recompute(store: Path, *extra: str) -> str:
    result = CliRunner().invoke(advantages, ["--store", str(store), "--lam", "0.7", *extra])
    assert result.exit_code == 0, result.output
    return result.output


def _files(store: Path, folder: str) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((store / folder).rglob("*")) if p.is_file()}


def _assert_same_store(serial: Path, other: Path) -> None:
    a, b = _files(serial, "advantages"), _files(other, "advantages")
    assert a and list(a) == list(b)
    for name in a:
        assert a[name] == b[name], name  # byte for byte, metadata included
        cols_a = pq.read_table(serial / "advantages" / _tag() / name, columns=ADVANTAGE_COLUMNS)
        cols_b = pq.read_table(other / "advantages" / _tag() / name, columns=ADVANTAGE_COLUMNS)
        assert cols_a.equals(cols_b)
    assert [q["reason"] for q in Store(str(serial)).quarantined()] == [
        q["reason"] for q in Store(str(other)).quarantined()
    ]


def _tag() -> str:
    return parse_estimator_config({"lam": 0.7}).tag


def test_processes_equal_serial_on_a_real_store(real_store, tmp_path):
    serial = _copy(real_store, tmp_path / "serial")
    pooled = _copy(real_store, tmp_path / "pooled")
    out_serial = _recompute(serial)
    out_pooled = _recompute(pooled, "--workers", "3")
    _assert_same_store(serial, pooled)
    assert len(_files(pooled, "advantages")) == 12
    # The summary line and the diagnostics, the store's name aside.
    assert out_serial.replace(str(serial), "S") == out_pooled.replace(str(pooled), "S")


def test_quarantine_decisions_are_the_serial_ones(tmp_path):
    """A torn shard, a shard repeating a group of an earlier one and a NaN reward: the same
    shards quarantined with the same reasons, and the rest written alike."""
    root = tmp_path / "base"
    store = Store(str(root))
    for i in range(6):
        store.write_shard(make_steps(run_id="r", shard_id=f"s{i}", groups=2), group_size=3)
    torn = store.write_shard(make_steps(run_id="r", shard_id="s6"), group_size=3)
    Path(torn.path).write_bytes(Path(torn.path).read_bytes()[:100])
    copy = make_steps(run_id="r", shard_id="s1").to_pydict()  # s1's groups, under id s7
    copy[C.SHARD_ID] = ["s7"] * len(copy[C.SHARD_ID])
    store.write_shard(
        make_steps(run_id="r", shard_id="s7").from_pydict(copy, schema=C.STEPS_SCHEMA),
        group_size=3,
    )
    serial = _copy(root, tmp_path / "serial")
    pooled = _copy(root, tmp_path / "pooled")
    _recompute(serial, "--quiet")
    _recompute(pooled, "--quiet", "--workers", "4")
    _assert_same_store(serial, pooled)
    reasons = [q["reason"] for q in Store(str(pooled)).quarantined()]
    assert len(reasons) == 2 and any("already in shard s1" in r for r in reasons), reasons


def test_encoding_is_the_stores(tmp_path):
    """A worker's bytes are what Store.write_parquet commits for the same table."""
    store = Store(str(tmp_path / "s"))
    config = parse_estimator_config({})
    steps = pl.from_arrow(make_steps().select(list(C.ADVANTAGE_INPUT_COLUMNS)))
    table = _arrow(compute_advantages(steps.lazy(), config).collect(), config)
    path = store.advantages_path(config.tag, "x")
    store.write_parquet(table, path, advantages_metadata(config))
    assert Path(path).read_bytes() == encode_parquet(table, advantages_metadata(config))


def test_at_most_n_shards_in_flight(monkeypatch):
    """The ordered map submits a new item only once one of `workers` is yielded."""
    state = {"flight": 0, "peak": 0}

    class Executor:
        def __enter__(self):
            def submit(fn, *args):
                state["flight"] += 1
                state["peak"] = max(state["peak"], state["flight"])

                def get():
                    state["flight"] -= 1
                    return fn(*args)

                return get

            return submit

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(parallel, "_executor", lambda *a: Executor())
    out = list(
        parallel.ordered_map(math.sqrt, [4, 9, 16, 25, 36, 49], workers=3, backend="processes")
    )
    assert out == [2, 3, 4, 5, 6, 7]
    assert state["peak"] == 3


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--input", "x.parquet", "--out", "y.parquet", "--workers", "2"],
            "--workers and --ray apply only with --store",
        ),
        (["--store", "s", "--workers", "0"], "Invalid value for '--workers'"),
    ],
)
def test_workers_misuse_is_one_line(tmp_path, args, message):
    (tmp_path / "x.parquet").write_bytes(b"")
    proc = subprocess.run(
        [sys.executable, "-m", "gagpo.pipeline.cli", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_ray_equals_serial_on_a_real_store(real_store, tmp_path, monkeypatch):
    """--ray: the workers are Ray tasks on a local instance (2 CPUs) started and shut down
    by the command; its files stay under RAY_TMPDIR."""
    pytest.importorskip("ray")
    ray_tmp = Path("/tmp") / f"gr{os.getpid()}"
    monkeypatch.setenv("RAY_TMPDIR", str(ray_tmp))
    serial = _copy(real_store, tmp_path / "serial")
    on_ray = _copy(real_store, tmp_path / "ray")
    _recompute(serial)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gagpo.pipeline.cli",
            "--store",
            str(on_ray),
            "--lam",
            "0.7",
            "--workers",
            "2",
            "--ray",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    _assert_same_store(serial, on_ray)
    assert not processes_naming(ray_tmp), "a Ray process of the local instance is left"
    shutil.rmtree(ray_tmp, ignore_errors=True)
