"""`gagpo run --ray`: the tiny recipe on a real local Ray instance (2 CPUs), as without Ray;
the same with an actor killed by `ray.kill` and the learner's process killed (restarted, with
fresh run id and seeds, and with --resume); afterwards no process the run started is left,
checked by the pids seen and by Ray's session folder, never by name."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from gagpo.schemas.errors import GagpoError
from gagpo.storage.store import Store
from gagpo.workflows import ray_run, ray_supervisor
from gagpo.workflows.layout import SEED_STRIDE, Plan, Process
from gagpo.workflows.ray_host import restarted_command, resumed_command
from gagpo.workflows.ray_placement import RankPlace, check_cluster, place, rendezvous
from gagpo.workflows.ray_restarts import event, restarts_text
from tests.helpers.procs import alive, processes_naming
from tests.helpers.ray_procs import GAGPO, QUICK, Run, ray_scratch

# --- the pure parts -------------------------------------------------------------------------


def test_a_restarted_actor_plays_a_fresh_run_and_seeds_no_one_else_plays():
    cmd = ["py", "-m", "gagpo.actors.cli", "--run-id", "r0", "--seed", str(7 + SEED_STRIDE), "--x"]
    assert restarted_command(cmd, 0, 3, "new") == cmd
    again = restarted_command(cmd, 2, 3, "r2")
    assert again[again.index("--run-id") + 1] == "r2"
    seed = int(again[again.index("--seed") + 1])
    assert seed == 7 + SEED_STRIDE + 2 * 3 * SEED_STRIDE  # actor 1, incarnation 2, 3 actors
    # Every (actor, incarnation) starts its own stride-long range of task seeds.
    starts = {7 + (i + r * 3) * SEED_STRIDE for i in range(3) for r in range(5)}
    assert len(starts) == 15


def test_a_restarted_learner_resumes():
    assert resumed_command(["l", "--store", "s"]) == ["l", "--store", "s", "--resume"]
    assert resumed_command(["l", "--resume"]) == ["l", "--resume"]


class _FakeCluster:
    """What give_up_placing asks of Ray: free resources, and kills."""

    def __init__(self):
        self.killed = []

    def available_resources(self):
        return {"CPU": 0.0, "memory": 1e9}

    def kill(self, handle, no_restart=True):
        self.killed.append(handle)


def test_an_actor_no_node_holds_is_lost_not_replaced_and_counted_apart():
    """Placed again after its node was lost, not held by any node within run.place_timeout_s:
    its new host is removed, it is counted lost (not a restart), and the run goes on."""
    from gagpo.workflows.run import RunConfig

    fake = _FakeCluster()
    waiting = ray_supervisor.Held("actor 1", "host-1", bundle=1, incarnation=1)
    waiting.placing = (time.monotonic() - 11.0, "its node 1a2b3c4d was lost", "RUN1")
    fresh = ray_supervisor.Held("actor 0", "host-0", incarnation=1)
    fresh.placing = (time.monotonic(), "its Ray actor died", "RUN0")
    events, lines = [], []
    ray_supervisor.give_up_placing(
        fake, [waiting, fresh], RunConfig(place_timeout_s=10.0), lines.append, events
    )
    assert waiting.gone and waiting.placing is None and fake.killed == ["host-1"]
    assert not fresh.gone and fresh.placing is not None  # still within the bound
    assert lines == [
        "[actor 1] (ray) lost, not replaced: no node could hold it within 10 s "
        "(the cluster has 0 CPU(s) free)"
    ]
    (lost,) = events
    assert (lost["process"], lost["replaced"]) == ("actor 1", False)
    assert lost["cause"] == "its node 1a2b3c4d was lost; no node could hold it within 10 s"
    events += [
        event("actor 0", 1, "R", "its Ray actor died"),
        event("learner", 1, None, "rank 0: its node 1a2b3c4d was lost"),
    ]
    assert restarts_text(events) == (
        "ray: 1 actor restart(s), 1 learner restart(s), 1 lost (not replaced) "
        "(actor 0 ×1, learner ×1; lost: actor 1)"
    )


def _plan(*sets: str, gpus_visible: int | None = None):
    from tests.helpers.plans import plan_for

    return plan_for(*sets, gpus_visible=gpus_visible)


def test_bundles_follow_the_plan():
    """Actors: a bundle each, a whole GPU or the share of one they share (the colocated
    gpu-alfworld). The learner: one bundle per node it spans, a whole GPU per rank
    (gpu-alfworld-8), STRICT_PACK on one node by default."""
    colocated = place(_plan("gpu-alfworld"))
    assert colocated.actor_bundles == [{"CPU": 1.0, "GPU": 0.35}]
    assert colocated.learner_bundles == [{"CPU": 1.0, "GPU": 0.65}]
    assert colocated.learner_strategy == "STRICT_PACK" and colocated.ranks == 1
    eight = place(_plan("gpu-alfworld-8"))
    assert eight.actor_bundles == [{"CPU": 1.0, "GPU": 1.0}] * 4
    assert eight.learner_bundles == [{"CPU": 4.0, "GPU": 4.0}] and eight.rank_gpu == 1.0
    assert eight.learner_strategy == "STRICT_PACK"
    cpu = place(_plan("tiny"))
    assert cpu.actor_bundles == [{"CPU": 1.0}] * len(cpu.actor_bundles)
    assert cpu.learner_bundles == [{"CPU": 1.0}] and cpu.rank_gpu == 0.0


def test_a_learner_wider_than_a_node_spans_nodes():
    plan = _plan("gpu-alfworld-8")
    assert plan.learner.ranks == 4 and plan.learner.rank_command[1:3] == ["-m", "gagpo.learner.cli"]
    auto = place(plan, 0, [2.0, 2.0, 2.0])  # no node holds 4 GPUs: the fewest nodes that do
    assert auto.learner_bundles == [{"CPU": 2.0, "GPU": 2.0}] * 2
    assert auto.learner_strategy == "STRICT_SPREAD" and auto.per_node == 2
    assert [auto.rank_bundle(r) for r in range(4)] == [0, 0, 1, 1]
    assert place(plan, 0, [8.0]).learner_nodes == 1  # one node holds them: it does
    assert place(plan, 4).learner_bundles == [{"CPU": 1.0, "GPU": 1.0}] * 4  # as asked
    with pytest.raises(GagpoError, match="learner_nodes = 3 does not divide the learner's 4"):
        place(plan, 3)


def test_gpu_counts_are_checked_against_the_cluster():
    """Against ray.cluster_resources() and each node's, never this machine's GPUs."""
    eight = place(_plan("gpu-alfworld-8"))
    node8 = {"CPU": 16.0, "GPU": 8.0}
    check_cluster(eight, {"CPU": 16.0, "GPU": 8.0}, [node8])
    with pytest.raises(GagpoError) as short:
        check_cluster(eight, {"CPU": 8.0, "GPU": 4.0}, [{"CPU": 8.0, "GPU": 4.0}])
    assert "needs 8 GPU(s) (actors: 4, learner: 4)" in str(short.value)
    assert "\n" not in str(short.value)
    small_nodes = [{"CPU": 4.0, "GPU": 2.0}] * 4  # 8 GPUs, but no node holds the learner's 4
    with pytest.raises(GagpoError, match=r"need 4 GPU\(s\) on one node, and 0 node\(s\) have"):
        check_cluster(eight, {"CPU": 16.0, "GPU": 8.0}, small_nodes)
    spread = place(_plan("gpu-alfworld-8"), 0, [2.0] * 4)
    check_cluster(spread, {"CPU": 16.0, "GPU": 8.0}, small_nodes)  # 2 ranks on each of 2 nodes
    colocated = place(_plan("gpu-alfworld"))  # 0.35 + 0.65 of one GPU
    check_cluster(colocated, {"CPU": 4.0, "GPU": 1.0}, [{"CPU": 4.0, "GPU": 1.0}])


def test_the_rendezvous_comes_from_where_the_ranks_landed():
    """Rank 0's node and port for everyone; local ranks per node; each rank sees its node's
    learner GPUs and LOCAL_RANK points at its own (learner/dist.py: cuda:LOCAL_RANK)."""
    places = [
        RankPlace("10.0.0.1", ("3",)),
        RankPlace("10.0.0.1", ("1",)),
        RankPlace("10.0.0.2", ("0",)),
        RankPlace("10.0.0.2", ("5",)),
    ]
    envs = rendezvous(places, 2, 29500)
    assert {e["MASTER_ADDR"] for e in envs} == {"10.0.0.1"}
    assert {e["MASTER_PORT"] for e in envs} == {"29500"}
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert {e["WORLD_SIZE"] for e in envs} == {"4"} and {e["LOCAL_WORLD_SIZE"] for e in envs} == {
        "2"
    }
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["1,3", "1,3", "0,5", "0,5"]
    assert [e["LOCAL_RANK"] for e in envs] == ["1", "0", "0", "1"]
    cpu = rendezvous([RankPlace("127.0.0.1"), RankPlace("127.0.0.1")], 2, 1234)
    assert [e["LOCAL_RANK"] for e in cpu] == ["0", "1"] and "CUDA_VISIBLE_DEVICES" not in cpu[0]


def test_dry_run_on_ray_prints_the_placement_and_starts_nothing(tmp_path):
    """Without an address: against this machine's resources, Ray not started; an impossible
    request is printed, then refused in one line with exit 2, as without --dry-run."""
    env = {**os.environ, "HOME": str(tmp_path), "TMPDIR": str(tmp_path)}
    store = tmp_path / "store"
    shown = subprocess.run(
        [*GAGPO, "run", "--recipe", "gpu-alfworld-8", "--store", str(store), "--dry-run", "--ray"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    out = shown.stdout
    placed = "0 GPU(s) over 1 node" not in out
    assert shown.returncode == (0 if placed else 2), shown.stderr
    assert "placement group gagpo-RUN-actors, strategy SPREAD" in out
    assert "placement group gagpo-RUN-learner, strategy STRICT_PACK" in out
    assert "bundle 0: {CPU: 4, GPU: 4}   learner rank(s) 0, 1, 2, 3" in out
    assert "rendezvous: MASTER_ADDR = rank 0's node" in out and "gagpo.learner.cli" in out
    assert "torch.distributed.run" not in out  # Ray, not torchrun, starts the ranks
    assert "this machine (no Ray started)" in out
    if not placed:
        assert shown.stderr.strip().count("\n") == 0
        assert "error: cannot be placed: the run needs 8 GPU(s)" in shown.stderr
        refused = subprocess.run(
            [*GAGPO, "run", "--recipe", "gpu-alfworld-8", "--store", str(store), "--ray"],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert refused.returncode == 2
        assert refused.stderr.strip().count("\n") == 0 and "needs 8 GPU(s)" in refused.stderr
        assert "ray:" not in refused.stdout  # no Ray instance started
    assert not store.exists() and not (tmp_path / "ray").exists()


class _FakeRay:
    def __init__(self, nodes: int):
        self._nodes = [{"Alive": True, "NodeID": str(i)} for i in range(nodes)]

    def nodes(self):
        return self._nodes


def test_a_local_store_no_other_node_sees_is_refused(tmp_path, monkeypatch):
    store = Store(str(tmp_path / "s"))
    monkeypatch.setattr(ray_run, "_probe_nodes", lambda ray, nodes, probe: [True, False])
    with pytest.raises(GagpoError, match="is a local path but the Ray cluster has 2 nodes"):
        ray_run.check_store_shared(_FakeRay(2), store)
    assert not list((tmp_path / "s").glob(".ray-probe-*"))  # the probe file is removed
    monkeypatch.setattr(ray_run, "_probe_nodes", lambda ray, nodes, probe: [True, True])
    ray_run.check_store_shared(_FakeRay(2), store)  # a shared file system
    ray_run.check_store_shared(_FakeRay(1), store)  # one node: anything goes


# --- real Ray -------------------------------------------------------------------------------


LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}


def _listening(pids: set[int]) -> set[tuple[str, int]]:
    """(address in /proc/net hex, port) of every TCP socket these processes listen on."""
    inodes = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("socket:["):
                        inodes.add(target[8:-1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                address, port = cols[1].split(":")
                found.add((address, int(port, 16)))
    return found


def _versions_used(store: Store) -> list[int]:
    versions: set[int] = set()
    for ref in store.list_shards():
        versions.update(pq.read_table(ref.path, columns=["policy_version"])[0].to_pylist())
    return sorted(versions)


def _assert_trained_as_without_ray(store_dir: Path, updates: int) -> Store:
    """What tests/test_recipes.py asserts of `gagpo run --recipe tiny` without Ray."""
    store = Store(str(store_dir))
    assert store.policies.latest() == updates
    assert list((store_dir / "advantages").glob("gagpo-*/*.parquet"))
    # At least two published versions were used by later shards.
    assert len(_versions_used(store)) >= 2, _versions_used(store)
    assert len(list((store_dir / "learner" / "metrics").glob("*.parquet"))) == updates
    return store


@pytest.mark.slow
def test_tiny_recipe_on_a_local_ray_instance(tmp_path):
    """`--ray` alone: a local instance with 2 CPUs for the run, shut down with every process
    it started; actors and learner logs reach the console with their prefixes."""
    pytest.importorskip("ray")
    ray_tmp = ray_scratch("a")
    env = {**os.environ, "RAY_TMPDIR": str(ray_tmp), "OMP_NUM_THREADS": "1"}
    store_dir = tmp_path / "store"
    run = Run(["--recipe", "tiny", "--store", str(store_dir), "--ray", *QUICK], env)
    seen: set[int] = set()
    listening: set[tuple[str, int]] = set()
    while run.proc.poll() is None:  # Ray's processes, as long as the run lasts
        now = processes_naming(ray_tmp)
        seen |= now
        listening |= _listening(now)
        time.sleep(1.0)
    assert run.finish() == 0, run.tail()
    out = run.text()
    _assert_trained_as_without_ray(store_dir, 3)
    assert "ray: started a local Ray instance at 127.0.0.1:" in out
    # The local instance listens on the loopback interface only, and has no dashboard.
    assert listening and {address for address, _ in listening} <= LOOPBACK, listening
    assert not any(port == 8265 for _, port in listening)
    assert re.search(r"^\[actor 0\] groups \d+", out, re.M)
    assert re.search(r"^\[learner\] update 3/3", out, re.M)
    assert "ray: 0 actor restart(s), 0 learner restart(s), 0 lost (not replaced)" in out
    assert re.search(
        r"^ray restarts: 0 actor restart\(s\), 0 learner restart\(s\), 0 lost "
        r"\(not replaced\); recorded in \S+/ray/restarts-\w+\.parquet$",
        out,
        re.M,
    )
    (recorded,) = (store_dir / "ray").glob("restarts-*.parquet")
    assert pq.read_table(recorded).num_rows == 0
    assert "policy_version" in out and re.search(r"groups: \d+ generated, \d+ trained", out)
    assert len(seen) >= 3, seen  # gcs, raylet, workers… were seen by their session folder
    children = run.child_pids()
    assert len(children) == 2
    time.sleep(1.0)
    left = {pid for pid in seen | children if alive(pid)}
    assert not left, f"processes of the run left: {left}"
    shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.mark.slow
def test_sigterm_stops_a_run_on_a_local_ray_instance():
    """SIGTERM to `gagpo run --ray` (a local instance): stopped as Ctrl-C stops it, exit 130,
    no native backtrace of Ray's, and no process of the run or of its instance left (Ray's
    agents included: they were still running after the driver aborted)."""
    pytest.importorskip("ray")
    scratch = ray_scratch("t")
    env = {**os.environ, "RAY_TMPDIR": str(scratch), "OMP_NUM_THREADS": "1"}
    run = Run(
        [
            "--recipe",
            "tiny",
            "--store",
            str(scratch / "store"),
            "--ray",
            "--no-warmstart",
            *QUICK,
            "--set",
            "learner.updates=30",
        ],
        env,
    )
    run.wait_for(r"^\[actor 0\] \(ray\) started pid")
    # Past its imports (a SIGINT during them is a traceback of Python's, not this test's case).
    run.wait_for(r"^\[learner\] (?!\(ray\))\S")
    seen = processes_naming(scratch)
    run.proc.send_signal(signal.SIGTERM)
    assert run.finish(timeout=300) == 130, run.tail()
    assert "interrupted: every process started was stopped" in run.text()
    assert "SIGTERM received" not in run.text(), run.tail()
    assert "Traceback" not in run.text(), run.tail()
    time.sleep(2.0)
    left = {pid for pid in seen | processes_naming(scratch) | run.child_pids() if alive(pid)}
    assert len(seen) >= 3 and not left, f"processes of the run left: {left}"
    shutil.rmtree(scratch, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster():
    """One local Ray instance (2 CPUs) for the module, started by this test process; the
    runs join it as a cluster (`--ray ADDRESS`). Its processes are ended by ray.shutdown()
    and checked gone by pid."""
    ray = pytest.importorskip("ray")
    ray_tmp = ray_scratch("c")
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _temp_dir=str(ray_tmp),
        namespace=ray_run.NAMESPACE,
        log_to_driver=False,
    )
    node = ray._private.worker._global_node
    pids = {p.process.pid for procs in node.all_processes.values() for p in procs}
    try:
        yield ray, ray.get_runtime_context().gcs_address, ray_tmp
    finally:
        ray.shutdown()
        time.sleep(1.0)
        assert not {pid for pid in pids | processes_naming(ray_tmp) if alive(pid)}
        shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.mark.slow
def test_a_killed_actor_and_a_killed_learner_are_restarted(cluster, tmp_path):
    """An actor's Ray actor killed with ray.kill after its first shard: the driver gives it a
    new host, where it plays under a fresh run id and other task seeds. Then the learner's process is killed:
    it is started again with --resume and the lineage goes on to the last update. Then no
    Ray actor of the run and none of its processes is left."""
    ray, address, _ = cluster
    store_dir = tmp_path / "store"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = Run(
        [
            "--recipe",
            "tiny",
            "--store",
            str(store_dir),
            "--ray",
            address,
            *QUICK,
            "--set",
            "learner.updates=5",
        ],
        env,
    )
    names = run.wait_for(r"Ray actors (\S+), (\S+)\)")
    actor_name, learner_name = names.group(1), names.group(2)
    first_actor = int(run.wait_for(r"^\[actor 0\] \(ray\) started pid (\d+)").group(1))
    store = Store(str(store_dir))
    deadline = time.monotonic() + 300
    while not store.list_shards():
        assert time.monotonic() < deadline and run.proc.poll() is None, run.tail()
        time.sleep(0.2)
    ray.kill(ray.get_actor(actor_name), no_restart=False)
    restart = run.wait_for(r"^\[actor 0\] \(ray\) started pid (\d+) .*restart 1: --run-id (\S+)")
    assert int(restart.group(1)) != first_actor
    learner_pid = int(run.wait_for(r"^\[learner\] \(ray\) started pid (\d+)").group(1))
    while (store.policies.latest() or 0) < 1:
        assert time.monotonic() < deadline + 300 and run.proc.poll() is None, run.tail()
        time.sleep(0.2)
    os.kill(learner_pid, signal.SIGKILL)  # as a rank dying: its process exits non-zero
    run.wait_for(r"^\[learner\] \(ray\) started pid \d+ .*restart 1: --resume")
    assert run.finish() == 0, run.tail()
    out = run.text()
    assert not alive(first_actor)  # the child died with its Ray actor
    store = _assert_trained_as_without_ray(store_dir, 5)
    counted = (
        "1 actor restart(s), 1 learner restart(s), 0 lost (not replaced) (actor 0 ×1, learner ×1)"
    )
    assert f"ray: {counted}" in out and f"ray restarts: {counted}" in out
    assert "Ray restarts it" not in out
    (recorded,) = (store_dir / "ray").glob("restarts-*.parquet")
    rows = {r["process"]: r for r in pq.read_table(recorded).to_pylist()}
    assert rows["actor 0"]["incarnation"] == 1 and rows["actor 0"]["run_id"] == restart.group(2)
    assert rows["actor 0"]["cause"] == "its Ray actor died" and rows["actor 0"]["replaced"]
    assert rows["learner"]["incarnation"] == 1 and "exited with -9" in rows["learner"]["cause"]
    runs = {ref.run_id for ref in store.list_shards()}
    assert restart.group(2) in runs and len(runs) == 2
    by_run: dict[str, set] = {}
    for ref in store.list_shards():
        tasks = pq.read_table(ref.path, columns=["task_id"])[0].to_pylist()
        by_run.setdefault(ref.run_id, set()).update(tasks)
    first, second = by_run.values()
    assert not first & second  # no task played twice: groups never repeat
    # Nothing of the run is left on the cluster: its Ray actors, their processes.
    for name in (actor_name, f"{actor_name}-r1", learner_name):
        with pytest.raises(ValueError):
            ray.get_actor(name)
    time.sleep(1.0)
    assert not {pid for pid in run.child_pids() if alive(pid)}


@pytest.mark.slow
def test_a_learner_of_two_ranks_placed_by_ray(cluster, tmp_path):
    """Two CPU ranks (gloo), each a Ray actor running the learner's own command line with the
    rendezvous Ray gave it (no torchrun): the same parameters as one process on the same
    data, as tests/test_learner_dist.py shows for torchrun."""
    from gagpo.workflows.run import RunConfig
    from tests.helpers.learner import (
        learner_args,
        learner_cmd,
        parameters,
        run_learner,
        write_shards,
    )

    ray, address, _ = cluster
    stores = {name: Store(str(tmp_path / name)) for name in ("one", "two")}
    for store in stores.values():
        write_shards(store, 3, groups=3)
    single = run_learner(*learner_args(tmp_path / "one", "--mini-batches", "1"))
    assert single.returncode == 0, single.stderr
    cmd = learner_cmd(*learner_args(tmp_path / "two", "--mini-batches", "1"))
    plan = Plan([Process("learner", cmd, env={"OMP_NUM_THREADS": "1"}, ranks=2)])
    lines: list[str] = []
    config = RunConfig(learner_restarts=0, stop_timeout_s=30)
    code = ray_run.run_on_ray(
        plan, config, lines.append, address=address, store=str(tmp_path / "two"), run_id="TWO"
    )
    out = "\n".join(lines)
    assert code == 0, out[-3000:]
    assert re.search(
        r"^\[learner\] \(ray\) started pid \d+ .*\(rank 0/2, rendezvous \S+:\d+\)", out, re.M
    )
    assert re.search(r"^\[learner rank 1\] \(ray\) started pid \d+ .*\(rank 1/2, ", out, re.M)
    assert "(1 rank(s)" not in out and "(2 rank(s) on 1 node(s))" in out
    a, b = parameters(stores["one"].policies.dir(3)), parameters(stores["two"].policies.dir(3))
    for name in a:
        np.testing.assert_allclose(a[name], b[name], atol=1e-5, rtol=0, err_msg=name)
    for name in ("gagpo-TWO-learner", "gagpo-TWO-learner-rank-1"):
        with pytest.raises(ValueError):
            ray.get_actor(name)
