"""Across processes: torchrun (2 CPU processes, gloo) against one process, and actors and
learner running asynchronously on one store."""

from __future__ import annotations

import signal
import subprocess

import numpy as np
import polars as pl
import pytest

from gagpo.learner.feed import STALE, TRAINED, Ledger
from gagpo.learner.metrics import read_metrics
from gagpo.schemas import columns as C
from gagpo.storage.store import Store
from tests.helpers.actors import actors_command
from tests.helpers.learner import (
    ENV,
    ROOT,
    learner_args,
    learner_beside_actors,
    parameters,
    run_learner,
    run_torchrun,
    tiny_model_dir,
    write_shards,
)


@pytest.mark.slow
def test_torchrun_two_processes_match_one(tmp_path):
    """Same data, same micro-batches: the summed gradients differ only in float summation
    order, so parameters agree to 1e-5 absolute after three AdamW steps."""
    stores = {}
    for name in ("one", "two"):
        stores[name] = Store(str(tmp_path / name))
        write_shards(stores[name], 3, groups=3)
    single = run_learner(*learner_args(tmp_path / "one", "--mini-batches", "1"))
    assert single.returncode == 0, single.stderr
    double = run_torchrun(*learner_args(tmp_path / "two", "--mini-batches", "1"))
    assert double.returncode == 0, double.stderr[-3000:]
    a, b = parameters(stores["one"].policies.dir(3)), parameters(stores["two"].policies.dir(3))
    base = parameters(tiny_model_dir())
    assert any(not np.array_equal(a[k], base[k]) for k in a)
    for name in a:
        np.testing.assert_allclose(a[name], b[name], atol=1e-5, rtol=0, err_msg=name)
    m1, m2 = read_metrics(stores["one"]), read_metrics(stores["two"])
    np.testing.assert_allclose(m1["loss"].to_numpy(), m2["loss"].to_numpy(), atol=1e-5)
    assert m1["actions"].to_list() == m2["actions"].to_list()


@pytest.mark.slow
def test_actors_and_learner_run_asynchronously(tmp_path):
    """Actors (follow mode) and the learner as separate processes on one store: the actors
    pick up published versions, shards carry increasing policy_version, and what the
    learner trains on stays within the staleness bound (older data is dropped, counted)."""
    store_dir, staleness = tmp_path / "store", 1
    actors = subprocess.Popen(
        actors_command(store_dir, env="household", follow=True, group_size=4, max_turns=3),
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        learner = subprocess.run(
            learner_beside_actors(store_dir, updates=4, batch_groups=2, max_staleness=staleness),
            cwd=ROOT,
            env=ENV,
            capture_output=True,
            text=True,
            timeout=400,
        )
        assert learner.returncode == 0, learner.stderr[-3000:]
        # Let the actors load the last version and write with it.
        store = Store(str(store_dir))
        for _ in range(600):
            versions = pl.concat(
                [
                    pl.from_arrow(store.read_table(r.path, [C.POLICY_VERSION]))
                    for r in store.list_shards()
                ]
            )[C.POLICY_VERSION]
            if versions.max() == 4:
                break
            subprocess.run(["sleep", "0.2"])
    finally:
        actors.send_signal(signal.SIGTERM)
        try:
            actors.wait(timeout=60)
        finally:
            actors.stderr.close()
    assert store.policies.latest() == 4
    shards = store.list_shards()  # ids are time-sortable: commit order
    per_shard = [
        store.read_table(r.path, [C.POLICY_VERSION])[C.POLICY_VERSION][0].as_py() for r in shards
    ]
    assert per_shard == sorted(per_shard) and per_shard[-1] == 4 and per_shard[0] == 0
    ledger = pl.from_arrow(Ledger.load(store).table())
    lag = ledger["learner_version"] - ledger[C.POLICY_VERSION]
    assert (lag.filter(ledger["status"] == TRAINED) <= staleness).all()
    assert (lag.filter(ledger["status"] == STALE) > staleness).all()
    metrics = read_metrics(store)
    assert metrics["stale_groups"].sum() == (ledger["status"] == STALE).sum()
    assert (metrics["staleness_max"] <= staleness).all()
