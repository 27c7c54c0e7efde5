"""Fault injection (issue 14): SIGKILL actors and the learner, again and again, while they
run together on one store, then check what a crash must never do (docs/design.md §7).

    python benchmarks/faults/run_faults.py                     # the full run, both stores
    python benchmarks/faults/run_faults.py --stores local --actor-kills 2 --learner-kills 2

Per store (a local folder, and S3 on a moto server on loopback):
- actors (tiny policy, sokoban, --follow) are started and SIGKILLed `actor_kills` times:
  a share of them held inside a shard commit (GAGPO_HOLD=commit-shards:<n>, temporary
  file written, not yet renamed or PUT), the rest at a random instant after start;
- meanwhile the learner (B = 1) is SIGKILLed `learner_kills` times, half held at a
  random phase of a random update (backward, checkpoint, publish, commit-learner, or those
  of --learner-phases; publish and checkpoint are held inside the writer threads), half
  at a random instant after its next publication, and restarted with --resume each time;
- a thread polls policy/LATEST throughout and checks that the version it names is complete;
- a steady actor supplies `updates` + 2 groups meanwhile; once it is done, a last
  --resume drains every committed group (B = 1: nothing left over).

Checks: every visible shard reads and validates (and none was quarantined); every
committed group is in the ledger exactly once and was trained (no group twice, none
skipped); update u made version u, for every u; each version's lineage record names the
version before it (number and id); LATEST never named an incomplete version; temporary
files older than the bound ($GAGPO_TEMP_MAX_AGE_S) left in the store once every writer
stopped, and after one more shard writer (the next writer sweeps them: storage/store.py).
Figures are printed and, with --json, written to a file (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LEARNER_PHASES = ("backward", "checkpoint", "publish", "commit-learner")
TEMP_BOUND_S = 20.0  # $GAGPO_TEMP_MAX_AGE_S for every process of the run


@dataclass
class Plan:
    actor_kills: int = 24
    commit_share: float = 0.5  # of actor kills, held inside a shard commit
    learner_kills: int = 12
    learner_phases: str = ",".join(LEARNER_PHASES)  # where held learner kills may land
    updates: int = 30  # groups of the steady actor: what the killed learners train on
    actor_delay_s: float = 10.0  # random actor kills: uniform(1, this) seconds after start
    group_size: int = 4
    max_turns: int = 4
    seed: int = 0
    timeout_s: float = 1500.0  # the whole run on one store


@dataclass
class Figures:
    store: str
    actor_kills: int = 0
    actor_commit_kills: int = 0
    learner_kills: int = 0
    learner_hold_kills: dict = field(default_factory=dict)
    # what each learner kill left: a policy folder newer than LATEST without its marker (a
    # publication in flight), a training-state folder without its marker (a state write)
    learner_kills_in_publication: int = 0
    learner_kills_in_state_write: int = 0
    latest_polls: int = 0
    latest_incomplete: int = 0
    shards: int = 0
    bad_visible_shards: int = 0
    quarantined: int = 0
    groups_committed: int = 0
    groups_in_ledger: int = 0
    groups_trained_twice: int = 0
    groups_skipped: int = 0
    updates: int = 0
    versions: int = 0
    update_version_mismatch: int = 0
    lineage_problems: list = field(default_factory=list)
    stale_temp_files: int = 0  # left when every writer has stopped (housekeeping is lazy)
    stale_temp_files_after_writer: int = 0  # after one more shard writer's first commit
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return (
            not (
                self.bad_visible_shards
                or self.quarantined
                or self.groups_trained_twice
                or self.groups_skipped
                or self.update_version_mismatch
                or self.lineage_problems
                or self.latest_incomplete
                or self.stale_temp_files_after_writer
            )
            and self.updates > 0
        )


# --- processes -----------------------------------------------------------------------
def _env(extra: dict | None = None) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GAGPO_TEMP_MAX_AGE_S": str(TEMP_BOUND_S)}
    for key in ("GAGPO_HOLD", "GAGPO_LEARNER_HOLD"):
        env.pop(key, None)
    return env | (extra or {})


def _gagpo(module: str, *args: str, env: dict | None = None, log=None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env=_env(env),
        stdout=log or subprocess.DEVNULL,
        stderr=log or subprocess.DEVNULL,
    )


def _kill(proc: subprocess.Popen) -> bool:
    """SIGKILL `proc`; whether it was still running (a kill, not a reaping)."""
    alive = proc.poll() is None
    if alive:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    return alive


def _wait_for(path: Path, proc: subprocess.Popen, timeout_s: float) -> bool:
    """True once `path` exists; False if the process ended or the time ran out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.05)
    return False


class Run:
    """One store under fire."""

    def __init__(self, url: str, plan: Plan, work: Path) -> None:
        from gagpo.storage.store import Store

        self.url, self.plan, self.work = url, plan, work
        self.rng = random.Random(plan.seed)
        self.store = Store(url, skip_instance_cache=True) if "://" in url else Store(url)
        self.figures = Figures(store="s3" if url.startswith("s3://") else "local")
        self.done = threading.Event()
        self.log = open(work / "processes.log", "ab")  # noqa: SIM115  (closed in `run`)

    def actor(self, seed: int, *extra: str, hold: str | None = None) -> subprocess.Popen:
        args = [
            "--store",
            self.url,
            "--policy",
            "tiny",
            "--env",
            "sokoban",
            "--group-size",
            str(self.plan.group_size),
            "--max-turns",
            str(self.plan.max_turns),
            "--seed",
            str(seed),
            "--threads",
            "1",
            "--backend",
            "transformers",
            *extra,
        ]
        env = {"GAGPO_HOLD": hold} if hold else None
        return _gagpo("gagpo.actors.cli", *args, env=env, log=self.log)

    def learner(self, updates: int, *extra: str, hold: str | None = None) -> subprocess.Popen:
        args = [
            "--store",
            self.url,
            "--policy",
            "tiny",
            "--updates",
            str(updates),
            "--batch-groups",
            "1",
            "--max-staleness",
            "100000",
            "--keep-versions",
            "100000",
            "--lr",
            "1e-3",
            "--micro-batch-tokens",
            "2048",
            "--poll-interval",
            "0.2",
            "--state-every",  # a state (written by a thread) every update: kills land in them
            "1",
            "--quiet",
            *extra,
        ]
        if "--idle-timeout" not in extra:  # a hold the data never reaches ends, not hangs
            args += ["--idle-timeout", "60"]
        env = {"GAGPO_LEARNER_HOLD": hold} if hold else None
        return _gagpo("gagpo.learner.cli", *args, env=env, log=self.log)

    # --- the three threads ----------------------------------------------------------
    def poll_latest(self) -> None:
        """LATEST must always name a complete version (its .complete marker present)."""
        while not self.done.is_set():
            try:
                self.store.fs.invalidate_cache()
                version = self.store.policies.latest()
                if version is not None:
                    self.figures.latest_polls += 1
                    if not self.store.policies.has(version):
                        self.figures.latest_incomplete += 1
            except Exception as exc:  # a read racing a rename is fine; a torn one is not
                print(f"  LATEST poll: {type(exc).__name__}: {exc}", file=sys.stderr)
            time.sleep(0.02)

    def kill_actors(self) -> None:
        plan, seed = self.plan, 1000
        commit_kills = round(plan.actor_kills * plan.commit_share)
        kinds = ["commit"] * commit_kills + ["random"] * (plan.actor_kills - commit_kills)
        self.rng.shuffle(kinds)
        for kind in kinds:
            seed += 100
            if kind == "commit":
                held = self.work / f"actor-held-{seed}"
                proc = self.actor(
                    seed,
                    "--follow",
                    "--no-throttle",
                    hold=f"commit-shards:{self.rng.randint(1, 3)}:{held}",
                )
                if _wait_for(held, proc, 300):
                    self.figures.actor_commit_kills += 1
            else:
                proc = self.actor(seed, "--follow", "--no-throttle")
                time.sleep(self.rng.uniform(1.0, plan.actor_delay_s))
            self.figures.actor_kills += _kill(proc)

    def kill_learner(self) -> None:
        plan = self.plan
        for k in range(plan.learner_kills):
            latest = self.store.policies.latest() or 0
            resume = ("--resume",) if k else ()
            if k % 2 == 0:  # held at a phase of one of the next two updates
                phase = self.rng.choice(plan.learner_phases.split(","))
                held = self.work / f"learner-held-{k}"
                update = latest + self.rng.randint(1, 2)
                proc = self.learner(plan.updates, *resume, hold=f"{phase}:{update}:{held}")
                if _wait_for(held, proc, 600):
                    self.figures.learner_hold_kills[phase] = (
                        self.figures.learner_hold_kills.get(phase, 0) + 1
                    )
            else:  # at a random instant after this run's first publication
                proc = self.learner(plan.updates, *resume)
                deadline = time.monotonic() + 600
                while (self.store.policies.latest() or 0) <= latest and proc.poll() is None:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.1)
                time.sleep(self.rng.uniform(0.0, 2.0))
            if _kill(proc):
                self.figures.learner_kills += 1
                self.count_writes_in_flight()

    def count_writes_in_flight(self) -> None:
        """Whether the kill cut a publication or a state write short (folders left without
        their marker; the next --resume removes them)."""
        from gagpo.learner.state import checkpoint_dir, state_versions
        from gagpo.storage.folders import is_complete

        self.store.fs.invalidate_cache()
        latest = self.store.policies.latest() or 0
        folders = self.store.policies.folders()
        if any(v > latest and not self.store.policies.has(v) for v in folders):
            self.figures.learner_kills_in_publication += 1
        states = state_versions(self.store)
        if any(not is_complete(self.store, checkpoint_dir(self.store, v)) for v in states):
            self.figures.learner_kills_in_state_write += 1

    # --- the run --------------------------------------------------------------------
    def run(self) -> Figures:
        t0 = time.monotonic()
        plan = self.plan
        poller = threading.Thread(target=self.poll_latest, daemon=True)
        poller.start()
        try:
            killers = [
                threading.Thread(target=self.kill_actors),
                threading.Thread(target=self.kill_learner),
            ]
            # One steady actor supplies what the learner needs while both are under fire.
            steady = self.actor(1, "--groups", str(plan.updates + 2))
            for thread in killers:
                thread.start()
            for thread in killers:
                thread.join()
            steady.wait(timeout=plan.timeout_s)
            # Drain: every committed group, whoever wrote it, trained exactly once.
            drain = self.learner(10**6, "--resume", "--idle-timeout", "5")
            if drain.wait(timeout=plan.timeout_s) not in (0, 3):  # 3: stopped when data ran out
                raise RuntimeError(f"the drain learner failed; see {self.work}/processes.log")
        finally:
            self.done.set()
            poller.join(timeout=10)
        self.check()
        if self.figures.stale_temp_files:  # the next writer into shards/ sweeps them
            self.actor(99, "--groups", "1").wait(timeout=plan.timeout_s)
            self.figures.stale_temp_files_after_writer = self._stale_temporaries()
        self.log.close()
        self.figures.seconds = round(time.monotonic() - t0, 1)
        return self.figures

    def check(self) -> None:
        import polars as pl

        from gagpo.learner.checkpoint import check_lineage
        from gagpo.learner.feed import STATUS, TRAINED, Ledger
        from gagpo.learner.metrics import read_metrics
        from gagpo.schemas import columns as C
        from gagpo.schemas.errors import ValidationError

        store, f = self.store, self.figures
        store.fs.invalidate_cache()
        committed = set()
        for ref in store.list_shards():
            f.shards += 1
            try:
                table = store.read_shard(ref)
            except (ValidationError, FileNotFoundError):
                f.bad_visible_shards += 1
                continue
            committed |= set(table.column(C.GROUP_ID).to_pylist())
        f.quarantined = len(store.quarantined())
        ledger = pl.from_arrow(Ledger.load(store).table())
        trained = ledger.filter(pl.col(STATUS) == TRAINED)
        f.groups_committed, f.groups_in_ledger = len(committed), ledger.height
        f.groups_trained_twice = trained.height - trained[C.GROUP_ID].n_unique()
        f.groups_skipped = len(committed - set(trained[C.GROUP_ID].to_list()))
        metrics = read_metrics(store)
        f.updates = metrics.height
        f.update_version_mismatch = int(
            (metrics["update"] != metrics["version"]).sum()
            + (metrics["update"].to_list() != list(range(1, f.updates + 1)))
            + (int(metrics["groups"].sum()) != trained.height)
        )
        versions = store.policies.folders()
        f.versions = len(versions)
        f.lineage_problems = check_lineage(store)
        if versions != list(range(store.policies.latest() + 1)):
            f.lineage_problems.append(f"versions not contiguous from v0: {versions[:5]}…")
        f.stale_temp_files = self._stale_temporaries()

    def _stale_temporaries(self) -> int:
        if not self.store.is_local:
            return 0  # a PUT is atomic: object stores hold no temporary names
        cutoff = time.time() - TEMP_BOUND_S
        stale = 0
        for folder, dirs, files in os.walk(self.store.root):
            for name in files + dirs:
                path = os.path.join(folder, name)
                if name.startswith(".tmp-") and os.path.getmtime(path) < cutoff:
                    stale += 1
        return stale


# --- stores --------------------------------------------------------------------------
def start_s3() -> object:
    """A moto S3 server on loopback with a bucket `gagpo-faults`, credentials in this
    process's environment (inherited by the actors and learners it starts)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from tests.helpers.s3 import start_s3 as start

    return start("gagpo-faults")[0]


def run_faults(stores: list[str], plan: Plan, work: Path) -> list[Figures]:
    results = []
    for kind in stores:
        folder = work / kind
        folder.mkdir(parents=True, exist_ok=True)
        server = start_s3() if kind == "s3" else None
        url = (
            f"s3://gagpo-faults/{folder.name}-{int(time.time())}"
            if server
            else str(folder / "store")
        )
        try:
            results.append(Run(url, plan, folder).run())
        finally:
            if server is not None:
                server.stop()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stores", default="local,s3", help="comma-separated: local, s3")
    for name, value in asdict(Plan()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument("--work", help="folder for the stores and logs (default: a temp folder)")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument(
        "--cases",
        default="kills",
        help="comma-separated: kills (the run above), issue 21's race, "
        "outage, full-disk (benchmarks/faults/cases.py) and issue 33's "
        "node-loss, process-group (benchmarks/faults/round4.py)",
    )
    args = parser.parse_args()
    plan = Plan(**{k: getattr(args, k) for k in asdict(Plan())})
    work = Path(args.work or tempfile.mkdtemp(prefix="gagpo-faults-"))
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    if cases != ["kills"]:
        from cases import CASES

        figures = {case: CASES[case](work) for case in cases if case != "kills"}
        print(json.dumps(figures, indent=1))
        if args.json:
            Path(args.json).write_text(json.dumps(figures))
        if "kills" not in cases:
            return
    results = run_faults([s.strip() for s in args.stores.split(",") if s.strip()], plan, work)
    for figures in results:
        print(json.dumps(asdict(figures) | {"ok": figures.ok}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) | {"ok": r.ok} for r in results]))
    print(f"work folder: {work}")
    sys.exit(0 if all(r.ok for r in results) else 1)


if __name__ == "__main__":
    main()
