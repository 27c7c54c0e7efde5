"""The fault cases of issue 33, run by `run_faults.py --cases node-loss,process-group`:

- node-loss: `gagpo run --ray ADDRESS` (tiny recipe, 2 actors) on a cluster of three nodes
  simulated here (`ray.cluster_utils.Cluster`: a head of 0 CPUs, two workers that each hold
  the whole run); mid-run the learner's node is removed, and in another trial the node of
  an actor apart from the learner. Counts runs that ended with exit 0, all their updates and
  one lineage, the restarts counted (and the lost), and anything of the run left alive.
- process-group: `gagpo run` (tiny, `--env-executor process`) in a process group of its own,
  as a terminal starts it, sent SIGINT to the whole group (Ctrl-C) or SIGTERM to its pid;
  and `gagpo run --ray` (a local instance) sent SIGTERM; and the driver of a run on the
  cluster above killed with SIGKILL. Counts exit 130 (-9 for the kill), tracebacks or Ray's
  native dump, and processes of the run left 10 s later.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

WORKER_CPUS = 3
QUICK = [
    "--no-warmstart",
    "--set",
    "run.eval_groups=0",
    "--set",
    "run.report=false",
    "--set",
    "run.credit=false",
]


def _cluster(work: Path):
    import ray
    from ray.cluster_utils import Cluster

    os.environ["RAY_" + "prestart_worker_first_driver"] = "0"
    import tempfile

    os.makedirs(os.path.join(tempfile.gettempdir(), "ray"), exist_ok=True)
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False}
    )
    ray.init(address=cluster.address, namespace="gagpo", log_to_driver=False)
    return ray, cluster


def _two_workers(cluster) -> None:
    while len(cluster.worker_nodes) < 2:
        cluster.add_node(num_cpus=WORKER_CPUS)
    cluster.wait_for_nodes()


def _group_nodes(ray, group: str) -> dict[int, str]:
    for info in ray.util.placement_group_table().values():
        if info["name"] == group and info["state"] == "CREATED":
            return dict(info["bundles_to_node_id"])
    return {}


def _left(ray, run, name: str, wait_s: float = 60.0) -> int:
    """Placement groups, Ray actors and processes of the run still alive after `wait_s`."""
    from tests.helpers.procs import alive

    deadline = time.monotonic() + wait_s
    while True:
        groups = [
            i
            for i in ray.util.placement_group_table().values()
            if i["name"].startswith(name) and i["state"] != "REMOVED"
        ]
        actors = [
            a
            for a in ray._private.state.actors().values()
            if a.get("Name", "").startswith(name) and a["State"] != "DEAD"
        ]
        children = [pid for pid in run.child_pids() if alive(pid)]
        left = len(groups) + len(actors) + len(children)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(1.0)


def _start_on(cluster, store: Path, updates: int):
    from tests.helpers.ray_procs import Run

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = Run(
        [
            "--recipe",
            "tiny",
            "--store",
            str(store),
            "--ray",
            cluster.address,
            *QUICK,
            "--set",
            "run.actors=2",
            "--set",
            f"learner.updates={updates}",
        ],
        env,
    )
    name = run.wait_for(r"placement groups (\S+)-learner, ").group(1)
    run.wait_for(r"^\[learner\] \(ray\) started pid")
    return run, name


def node_loss(work: Path, trials: int = 1, updates: int = 4) -> dict:
    from gagpo.learner.checkpoint import check_lineage
    from gagpo.learner.metrics import read_metrics
    from gagpo.storage.store import Store

    ray, cluster = _cluster(work)
    out = {"learner_node": {}, "actor_node": {}}
    try:
        for which in ("learner_node", "actor_node"):
            figures = out[which] = {
                "trials": 0,
                "exit_0": 0,
                "all_updates": 0,
                "one_lineage": 0,
                "restart_counted": 0,
                "lost": 0,
                "said_ray_restarts_it": 0,
                "left_alive": 0,
            }
            for trial in range(trials):
                _two_workers(cluster)
                store_dir = work / f"node-loss-{which}-{trial}"
                run, name = _start_on(cluster, store_dir, updates)
                store = Store(str(store_dir))
                while (store.policies.latest() or 0) < 1 and run.proc.poll() is None:
                    time.sleep(0.3)
                (learner_node,) = _group_nodes(ray, f"{name}-learner").values()
                actors = _group_nodes(ray, f"{name}-actors")
                node = learner_node
                if which == "actor_node":
                    node = min((i, n) for i, n in actors.items() if n != learner_node)[1]
                cluster.remove_node(next(w for w in cluster.worker_nodes if w.node_id == node))
                code = run.finish(timeout=900)
                text = run.text()
                figures["trials"] += 1
                figures["exit_0"] += code == 0
                figures["all_updates"] += store.policies.latest() == updates
                metrics = read_metrics(store)
                figures["one_lineage"] += check_lineage(store) == [] and metrics[
                    "update"
                ].to_list() == list(range(1, updates + 1))
                wanted = "1 learner restart(s)" if which == "learner_node" else "1 actor restart(s)"
                figures["restart_counted"] += bool(
                    re.search(rf"^ray restarts: .*{re.escape(wanted)}", text, re.M)
                )
                lost = re.search(r"^ray restarts: .* (\d+) lost", text, re.M)
                figures["lost"] += int(lost.group(1)) if lost else 0
                figures["said_ray_restarts_it"] += "Ray restarts it" in text
                figures["left_alive"] += _left(ray, run, name)
    finally:
        ray.shutdown()
        cluster.shutdown()
    return out


def _local_run(work: Path, tag: str, *extra: str, session: bool = True) -> tuple:
    # Ray's socket paths (RAY_TMPDIR/session_<date>_<pid>/sockets/plasma_store) must fit
    # AF_UNIX's 107 bytes: a folder named after the case under the work folder did not
    # (`gagpo run --ray` then failed to start, exit 1, and the case was counted failed).
    ray_tmp = tempfile.mkdtemp(prefix="ray-", dir=str(work) if len(str(work)) < 30 else None)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_TMPDIR": ray_tmp}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gagpo.workflows.cli",
            "run",
            "--recipe",
            "tiny",
            "--store",
            str(work / f"pg-{tag}"),
            *QUICK,
            "--set",
            "learner.updates=30",
            *extra,
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=session,
    )
    return proc, env


def _stop_and_count(
    proc, sig: int, group: bool, started: str, figures: dict, expect: int, folder: Path | None
) -> None:
    from tests.helpers.procs import alive, processes_naming

    lines = []
    for line in proc.stdout:
        lines.append(line)
        if re.search(started, line):
            break
    time.sleep(3.0)
    seen = processes_naming(folder) if folder is not None else set()
    (os.killpg if group else os.kill)(proc.pid, sig)
    lines += proc.stdout.readlines()
    code = proc.wait(timeout=300)
    text = "".join(lines)
    time.sleep(10.0)
    pids = {int(p) for found in re.findall(r"pids? ([\d, ]+)\)", text) for p in found.split(", ")}
    pids |= {int(p) for p in re.findall(r"\(ray\) started pid (\d+)", text)}
    if folder is not None:
        pids |= seen | processes_naming(folder)
    figures["trials"] += 1
    figures[f"exit_{expect}"] = figures.get(f"exit_{expect}", 0) + (code == expect)
    dumped = "Traceback" in text or "SIGTERM received" in text
    figures["traceback_or_native_dump"] += dumped
    figures["processes_left"] += sum(1 for pid in pids if alive(pid))
    if dumped or code != expect:  # what it said, to tell a regression from the machine
        said = [line.strip() for line in text.splitlines() if line.strip()]
        figures.setdefault("failed", []).append({"exit": code, "last_lines": said[-8:]})


def process_group(work: Path, trials: int = 1) -> dict:
    out = {}
    cases = {
        "ctrl_c_to_group_process_executor": (
            signal.SIGINT,
            True,
            ["--set", "actors.env_executor=process"],
            False,
        ),
        "sigterm_local": (signal.SIGTERM, False, [], False),
        "sigterm_ray_local": (signal.SIGTERM, False, ["--ray"], True),
    }
    for case, (sig, group, extra, on_ray) in cases.items():
        figures = out[case] = {"trials": 0, "traceback_or_native_dump": 0, "processes_left": 0}
        for trial in range(trials):
            proc, env = _local_run(work, f"{case}-{trial}", *extra)
            started = r"^\[learner\] \(ray\) started pid" if on_ray else r"^learner started"
            folder = Path(env["RAY_TMPDIR"]) if on_ray else None
            _stop_and_count(proc, sig, group, started, figures, 130, folder)
    ray, cluster = _cluster(work)
    figures = out["sigkill_driver_on_cluster"] = {"trials": 0, "exit_-9": 0, "left_alive": 0}
    try:
        for trial in range(trials):
            _two_workers(cluster)
            run, name = _start_on(cluster, work / f"kill-{trial}", 30)
            run.wait_for(r"^\[actor 1\] \(ray\) started pid")
            os.kill(run.proc.pid, signal.SIGKILL)
            figures["trials"] += 1
            figures["exit_-9"] += run.finish(timeout=120) == -9
            figures["left_alive"] += _left(ray, run, name)
    finally:
        ray.shutdown()
        cluster.shutdown()
    return out


CASES = {"node-loss": node_loss, "process-group": process_group}
