"""Issue 33: a Ray node lost mid-run, and a driver stopped or killed, on a cluster of three
nodes simulated on this machine (`ray.cluster_utils.Cluster`, one raylet each): a head that
holds no process of the run (0 CPUs) and two worker nodes, each able to hold the whole run
once the other is gone. The run is `gagpo run --ray ADDRESS`, tiny recipe, 2 actors.

- the learner's node removed: its ranks go to a new placement group on the node left and
  resume with --resume, one lineage, to the last update; the restart is counted;
- an actor's node removed: the actor gets a new host, placed again by Ray on the node left,
  and plays under a fresh run id; the restart is counted, and "Ray restarts it" is never said;
- the driver stopped with SIGTERM or killed with SIGKILL: no Ray actor, placement group or
  process of the run is left.

Afterwards nothing the run started is alive (by pid, by Ray actor name, by placement group)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import tempfile
import time

import pyarrow.parquet as pq
import pytest

from gagpo.learner.checkpoint import check_lineage
from gagpo.learner.metrics import read_metrics
from gagpo.storage.store import Store
from gagpo.workflows import ray_run
from tests.helpers.procs import alive, processes_naming
from tests.helpers.ray_procs import QUICK, Run, ray_scratch

pytestmark = pytest.mark.slow

WORKER_CPUS = 3  # one worker node holds the whole run: 2 actors and the learner
UPDATES = 4
PRESTART = "RAY_" + "prestart_worker_first_driver"  # Ray's own spelling of its setting


@pytest.fixture(scope="module")
def nodes():
    """The cluster for the module, shut down with every process it started (by pid)."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    scratch = ray_scratch("n")
    before = os.environ.get(PRESTART)
    os.environ[PRESTART] = "0"  # no idle workers started ahead: 2 cores here
    os.makedirs(os.path.join(tempfile.gettempdir(), "ray"), exist_ok=True)  # its address file
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "include_dashboard": False, "temp_dir": str(scratch)},
    )
    try:
        ray.init(address=cluster.address, namespace=ray_run.NAMESPACE, log_to_driver=False)
        yield ray, cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        if before is None:
            os.environ.pop(PRESTART, None)
        else:
            os.environ[PRESTART] = before
        time.sleep(1.0)
        assert not {pid for pid in processes_naming(scratch) if alive(pid)}
        shutil.rmtree(scratch, ignore_errors=True)


def _two_workers(cluster) -> None:
    """Two worker nodes alive (a previous test removed one: a node is added, as an
    autoscaler would)."""
    while len(cluster.worker_nodes) < 2:
        cluster.add_node(num_cpus=WORKER_CPUS)
    cluster.wait_for_nodes()


def _start(cluster, store_dir, *sets: str) -> tuple[Run, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = Run(
        [
            "--recipe",
            "tiny",
            "--store",
            str(store_dir),
            "--ray",
            cluster.address,
            "--no-warmstart",
            *QUICK,
            "--set",
            "run.actors=2",
            *sets,
        ],
        env,
    )
    name = run.wait_for(r"placement groups (\S+)-learner, ").group(1)
    run.wait_for(r"^\[learner\] \(ray\) started pid")
    return run, name


def _bundle_nodes(ray, group: str) -> dict[int, str]:
    """The node of each bundle of the run's placement group named `group`."""
    for info in ray.util.placement_group_table().values():
        if info["name"] == group and info["state"] == "CREATED":
            return dict(info["bundles_to_node_id"])
    raise AssertionError(f"no placement group {group}")


def _wait_for_version(run: Run, store: Store, version: int) -> None:
    deadline = time.monotonic() + 300
    while (store.policies.latest() or 0) < version:
        assert time.monotonic() < deadline and run.proc.poll() is None, run.tail()
        time.sleep(0.3)


def _assert_one_lineage(store: Store, updates: int = UPDATES) -> None:
    """Every update made once, each version after the one before it (tests/helpers/lineage.py
    asserts the same of a learner resumed by hand)."""
    assert store.policies.latest() == updates
    assert check_lineage(store) == []
    metrics = read_metrics(store)
    assert metrics["update"].to_list() == list(range(1, updates + 1))
    assert metrics["version"].to_list() == list(range(1, updates + 1))


def _assert_nothing_left(ray, run: Run, name: str) -> None:
    """No placement group, Ray actor or process of the run alive."""
    deadline = time.monotonic() + 60
    while True:
        groups = [
            i["state"]
            for i in ray.util.placement_group_table().values()
            if i["name"].startswith(name)
        ]
        actors = [
            a
            for a in ray._private.state.actors().values()
            if a.get("Name", "").startswith(name) and a["State"] != "DEAD"
        ]
        children = {pid for pid in run.child_pids() if alive(pid)}
        if not children and not actors and set(groups) <= {"REMOVED"}:
            return
        assert time.monotonic() < deadline, (groups, actors, children)
        time.sleep(1.0)


def _restarts(store_dir) -> list[dict]:
    (recorded,) = (store_dir / "ray").glob("restarts-*.parquet")
    return pq.read_table(recorded).to_pylist()


def test_the_learners_node_lost(nodes, tmp_path):
    """The learner's node removed after v1: a new placement group on the node left, every
    rank started again with --resume, the run ends with all its updates on one lineage."""
    ray, cluster = nodes
    _two_workers(cluster)
    store_dir = tmp_path / "store"
    run, name = _start(cluster, store_dir, "--set", f"learner.updates={UPDATES}")
    _wait_for_version(run, Store(str(store_dir)), 1)
    (node,) = _bundle_nodes(ray, f"{name}-learner").values()
    with_it = sorted(i for i, n in _bundle_nodes(ray, f"{name}-actors").items() if n == node)
    cluster.remove_node(next(w for w in cluster.worker_nodes if w.node_id == node))
    assert run.finish() == 0, run.tail()
    out = run.text()
    assert re.search(
        rf"^\[learner\] \(ray\) rank 0: its node {node[:8]} was lost; every rank "
        r"restarts with --resume on a new placement group$",
        out,
        re.M,
    ), run.tail()
    assert re.search(r"^\[learner\] \(ray\) started pid \d+ .*restart 1: --resume$", out, re.M)
    _assert_one_lineage(Store(str(store_dir)))
    counted = f"{len(with_it)} actor restart(s), 1 learner restart(s), 0 lost (not replaced)"
    assert f"ray: {counted}" in out and f"ray restarts: {counted}" in out
    rows = _restarts(store_dir)
    (learner,) = [r for r in rows if r["process"] == "learner"]
    assert learner["replaced"] and learner["incarnation"] == 1
    assert learner["cause"] == f"rank 0: its node {node[:8]} was lost"
    assert "Ray restarts it" not in out
    _assert_nothing_left(ray, run, name)


def test_an_actors_node_lost(nodes, tmp_path):
    """The node of an actor (not the learner's) removed once it committed a shard: a new
    host in its bundle, which Ray places on the node left; it plays under a fresh run id."""
    ray, cluster = nodes
    _two_workers(cluster)
    store_dir = tmp_path / "store"
    run, name = _start(cluster, store_dir, "--set", f"learner.updates={UPDATES}")
    store = Store(str(store_dir))
    _wait_for_version(run, store, 1)
    (learner_node,) = _bundle_nodes(ray, f"{name}-learner").values()
    apart = {i: n for i, n in _bundle_nodes(ray, f"{name}-actors").items() if n != learner_node}
    assert apart, "SPREAD left no actor apart from the learner"
    i, node = min(apart.items())
    cluster.remove_node(next(w for w in cluster.worker_nodes if w.node_id == node))
    run.wait_for(
        rf"^\[actor {i}\] \(ray\) its node {node[:8]} was lost; placing it again "
        r"\(restart 1 of 3"
    )
    restart = run.wait_for(rf"^\[actor {i}\] \(ray\) started pid \d+ .*restart 1: --run-id (\S+)")
    assert run.finish() == 0, run.tail()
    out = run.text()
    _assert_one_lineage(store)
    counted = f"1 actor restart(s), 0 learner restart(s), 0 lost (not replaced) (actor {i} ×1)"
    assert f"ray: {counted}" in out and f"ray restarts: {counted}" in out
    (row,) = _restarts(store_dir)
    assert (row["process"], row["incarnation"], row["replaced"]) == (f"actor {i}", 1, True)
    assert row["cause"] == f"its node {node[:8]} was lost" and row["run_id"] == restart.group(1)
    assert "Ray restarts it" not in out
    _assert_nothing_left(ray, run, name)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_driver_stopped_or_killed_leaves_nothing(nodes, tmp_path, sig):
    """SIGTERM stops the run as Ctrl-C does (exit 130, no native backtrace); SIGKILL leaves
    the cleanup to Ray: the run's Ray job ends, and its Ray actors and placement groups with
    it. Either way no Ray actor, placement group or process of the run is left."""
    ray, cluster = nodes
    _two_workers(cluster)
    run, name = _start(cluster, tmp_path / "store", "--set", "learner.updates=30")
    run.wait_for(r"^\[actor 1\] \(ray\) started pid")
    os.kill(run.proc.pid, sig)
    code = run.finish(timeout=300)
    if sig == signal.SIGTERM:
        assert code == 130, run.tail()
        assert "interrupted: every process started was stopped" in run.text()
        assert "SIGTERM received" not in run.text()
    else:
        assert code == -signal.SIGKILL
    _assert_nothing_left(ray, run, name)
