"""Issue 46 (reliability round 6), the store: policy versions, LATEST, delta records, training
states and loads files are confined as the archive is.

Each hostile store of the round, turned into a test: a delta version whose `files` climb out
of the store, whose base is itself or a version after it (a cycle), or whose chain is too
long; a LATEST that is huge, negative, a folder, a link or names no complete version; a
policy folder, a weights file, a training state or trainer.pt reached through a symbolic
link; torn and hostile training states under `--resume`; a loads file of other columns. Each
is refused in one line naming the file, the file outside is untouched, and nothing is left
in the actors' cache. Then what the review found: under FSDP on an object store each rank
fetches only its own optimiser shard, the actors' cache is swept (old copies and the
staging folders of cut fetches, their size said), a store written by the code before issue
40 resumes, and the exact-resume kill tests hold with the default state settings.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from gagpo.actors.prefetch import Prefetcher
from gagpo.inspection.sql import close_store_db, open_store_db, run_query
from gagpo.learner import checkpoint as CK
from gagpo.learner import publish as P
from gagpo.learner import state as ST
from gagpo.learner.config import LearnerConfig
from gagpo.learner.model import load_model
from gagpo.learner.train import train
from gagpo.schemas import layout
from gagpo.schemas.errors import GagpoError
from gagpo.storage import delta as D
from gagpo.storage.policy_cache import VersionCache
from gagpo.storage.store import Store
from tests.helpers.learner import ROOT, parameters, tiny_model_dir, write_shards

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def one_line(error: BaseException, *names: str) -> str:
    """The error's text, checked to be one line that names each of `names`."""
    text = str(error)
    assert "\n" not in text, text
    for name in names:
        assert name in text, (name, text)
    return text


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- delta versions ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def delta_store(tmp_path_factory):
    """v1 full, v2 and v3 deltas of the tiny policy (bf16), in a local store."""
    root = tmp_path_factory.mktemp("delta") / "store"
    store = Store(str(root))
    model = load_model(tiny_model_dir(), torch.device("cpu"))
    publisher = P.Publisher(
        store, model, tiny_model_dir(), keep=100, asynchronous=False, delta_every=10
    )
    for version in (1, 2, 3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(
                    1e-3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(version))
                )
        weights = P.take_weights(model, dtype=torch.bfloat16)
        publisher.publish(P.VersionCopy(version, version, weights, None, torch.bfloat16))
        publisher.wait()
    assert [store.policies.is_delta(v) for v in (1, 2, 3)] == [False, True, True]
    return root


@pytest.fixture
def hostile(delta_store, tmp_path):
    """A copy of the delta store, a victim file beside it, and an empty cache."""
    root = tmp_path / "a" / "b" / "store"
    shutil.copytree(delta_store, root)
    victim = tmp_path / "victim.safetensors"
    victim.write_bytes(b"precious" * 100)
    return Store(str(root)), victim, tmp_path / "cache"


def rewrite_record(store: Store, version: int, change) -> None:
    path = Path(layout.delta(store.policies.dir(version)))
    record = json.loads(path.read_text())
    change(record)
    path.write_text(json.dumps(record))


def left_in(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.rglob("*") if p.is_dir()) if cache.exists() else []


@pytest.mark.parametrize("name", ["climb", "absolute"])
def test_a_delta_file_name_that_is_a_path_is_refused_and_nothing_outside_changes(hostile, name):
    store, victim, cache = hostile
    before = digest(victim)
    target = "../../../victim.safetensors" if name == "climb" else str(victim)

    def change(record):
        record["files"] = {target: next(iter(record["files"].values()))}

    rewrite_record(store, 2, change)
    with pytest.raises(GagpoError) as err:
        store.policies.fetch(2, str(cache))
    one_line(err.value, "delta.json", "no plain weights file name")
    assert digest(victim) == before
    assert not any(n.endswith(".partial") for n in left_in(cache))
    with pytest.raises(GagpoError, match="no plain weights file name"):  # the learner's resume
        CK._published_weights(store, 2, str(cache))
    assert digest(victim) == before


@pytest.mark.parametrize("cycle", ["itself", "v2<->v3", "negative", "text"])
def test_a_delta_base_that_is_no_lower_version_is_refused_in_one_line(hostile, cycle):
    """A base must be a version below the delta's own: a chain only descends, so it ends.
    Before: unbounded recursion, a RecursionError and one .partial folder per call."""
    store, _, cache = hostile
    bases = {"itself": {2: 2}, "v2<->v3": {2: 3, 3: 2}, "negative": {3: -5}, "text": {3: "x"}}
    for version, base in bases[cycle].items():
        rewrite_record(store, version, lambda r, b=base: r.update(base=b))
    with pytest.raises(GagpoError) as err:
        store.policies.fetch(3, str(cache))
    one_line(err.value, "delta.json", "is not a version below")
    assert left_in(cache) == [] or not any(n.endswith(".partial") for n in left_in(cache))
    with pytest.raises(GagpoError):  # pruning, which walks the chain, refuses too
        store.policies.needed_by({3})


def test_a_delta_chain_longer_than_the_bound_is_refused_before_any_download(hostile, monkeypatch):
    store, _, cache = hostile
    monkeypatch.setattr(D, "MAX_CHAIN", 1)
    with pytest.raises(GagpoError) as err:
        store.policies.fetch(3, str(cache))
    one_line(err.value, "chain of more than 1 deltas")
    assert left_in(cache) == []
    monkeypatch.undo()
    assert (Path(store.policies.fetch(3, str(cache))) / "model.safetensors").is_file()


def test_a_huge_or_foreign_delta_record_is_refused(hostile):
    store, _, cache = hostile
    path = Path(layout.delta(store.policies.dir(2)))
    path.write_bytes(b"[" * (D.RECORD_MAX_BYTES + 10))
    with pytest.raises(GagpoError) as err:
        store.policies.fetch(2, str(cache))
    one_line(err.value, "delta.json", "more than")
    path.write_text(json.dumps({"base": 1, "encoding": "other", "files": {}}))
    with pytest.raises(GagpoError, match="encoding"):
        store.policies.fetch(2, str(cache))


# --- symbolic links in policy/ and learner/checkpoints/ -------------------------------------
def test_a_symlinked_version_folder_or_weights_file_is_never_read(hostile, tmp_path):
    store, victim, cache = hostile
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(store.policies.dir(1), elsewhere)
    v1 = Path(store.policies.dir(1))
    shutil.rmtree(v1)
    v1.symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(GagpoError) as err:
        store.policies.fetch(1, str(cache))
    one_line(err.value, "policy/v1", "symbolic link")
    with pytest.raises(GagpoError, match="symbolic link"):  # a delta on it reads it too
        store.policies.fetch(2, str(cache))
    v1.unlink()
    shutil.copytree(elsewhere, v1)
    (v1 / "model.safetensors").unlink()
    (v1 / "model.safetensors").symlink_to(victim)
    with pytest.raises(GagpoError) as err:
        store.policies.fetch(1, str(cache))
    one_line(err.value, "model.safetensors", "symbolic link")
    assert not any(n.endswith(".partial") for n in left_in(cache))


# --- LATEST -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("content", "why"),
    [
        ("99999999999\n", "accepted: a version number from 0 to 9999999"),
        ("-5\n", "accepted: a version number"),
        ("007\n", "accepted: a version number"),
        ("seven\n", "accepted: a version number"),
        ("7" * 100000, "accepted: a version number"),
        (None, "is a folder"),
    ],
)
def test_latest_is_a_bounded_number_or_one_line(hostile, content, why):
    """Before: 99999999999 made gagpo sql (report, view) build a row per version until
    memory ran out, a folder gave IsADirectoryError tracebacks, -5 was accepted."""
    store, _, _ = hostile
    latest = Path(layout.latest(store.root))
    latest.unlink()
    if content is None:
        latest.mkdir()
    else:
        latest.write_text(content)
    with pytest.raises(GagpoError) as err:
        store.policies.latest()
    one_line(err.value, "policy/LATEST", why)
    started = time.monotonic()
    with pytest.raises(GagpoError) as err:
        open_store_db(store)
    one_line(err.value, "policy/LATEST")
    assert time.monotonic() - started < 30


def test_latest_names_a_complete_version(hostile):
    store, _, _ = hostile
    store.policies.set_latest(9)
    assert store.policies.latest() == 9  # the number is well formed...
    with pytest.raises(GagpoError) as err:  # ...but no complete version: sql, report, resume
        store.policies.latest(complete=True)
    one_line(err.value, "policy/LATEST", "v9", "no complete version")
    with pytest.raises(GagpoError, match="no complete version"):
        open_store_db(store)
    with pytest.raises(GagpoError) as err:
        store.policies.set_latest(layout.MAX_VERSION)
    one_line(err.value, "cannot be published")


def test_a_symlinked_latest_is_refused(hostile, tmp_path):
    store, _, _ = hostile
    outside = tmp_path / "outside-latest"
    outside.write_text("1\n")
    latest = Path(layout.latest(store.root))
    latest.unlink()
    latest.symlink_to(outside)
    with pytest.raises(GagpoError) as err:
        store.policies.latest()
    one_line(err.value, "LATEST", "symbolic link")


def test_policy_versions_is_built_as_columns_up_to_latest(hostile):
    store, _, _ = hostile
    connection = open_store_db(store)
    try:
        got = run_query(connection, "SELECT version, published, stored FROM policy_versions")
    finally:
        close_store_db(connection)
    rows = {r["version"]: (r["published"], r["stored"]) for r in got.to_pylist()}
    assert rows == {0: (True, False), 1: (True, True), 2: (True, True), 3: (True, True)}


# --- loads files --------------------------------------------------------------------------
def test_a_loads_file_of_other_columns_is_refused_not_shown_as_nulls(hostile, capsys):
    from gagpo.storage.registry import LoadLog

    store, _, _ = hostile

    LoadLog(store, "actor1").add(1, 0.5, 0.1, 0.2)
    foreign = layout.loads(store.root, "actor2", layout.new_id())
    pq.write_table(pa.table({"x": [1, 2, 3]}), foreign)
    misnamed = Path(layout.loads_dir(store.root)) / "notes.parquet"
    shutil.copy(foreign, misnamed)
    connection = open_store_db(store)
    try:
        got = run_query(connection, "SELECT run_id, version FROM policy_loads")
    finally:
        close_store_db(connection)
    assert got.to_pylist() == [{"run_id": "actor1", "version": 1}]
    warned = capsys.readouterr().err
    assert Path(foreign).name in warned and "no column 'run_id'" in warned
    assert "notes.parquet" not in warned  # not of the layout's names: never listed


# --- training states under --resume -----------------------------------------------------------
def in_process(root: Path, **options) -> LearnerConfig:
    settings = dict(
        store=str(root),
        policy=str(tiny_model_dir()),
        batch_groups=2,
        lr=3e-3,
        micro_batch_tokens=96,
        poll_interval_s=0.05,
        idle_timeout_s=0.5,
        state_every=1,
        keep_versions=100,
    )
    return LearnerConfig(**{**settings, **options})


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A store the learner trained 3 updates on, with a state at every version."""
    root = tmp_path_factory.mktemp("trained") / "store"
    store = Store(str(root))
    write_shards(store, 5, groups=2)
    store.policies.publish_base(str(tiny_model_dir()))
    store.policies.set_latest(0)
    train(in_process(root, updates=3))
    assert store.policies.latest() == 3 and store.exists(ST.checkpoint_dir(store, 3))
    return root


def _trainer_list(path: Path) -> None:
    torch.save([1, 2, 3], path)


def _pickle(path: Path) -> None:
    import pickle

    path.write_bytes(pickle.dumps({"optimizer": subprocess.Popen}))


def _wrong_shapes(path: Path) -> None:
    trainer = torch.load(path, weights_only=True)
    for moments in trainer["optimizer"]["state"].values():
        moments["exp_avg"] = torch.zeros(3)
    torch.save(trainer, path)


def _no_rng(path: Path) -> None:
    trainer = torch.load(path, weights_only=True)
    trainer["rng"] = {"torch": "x"}
    torch.save(trainer, path)


TORN = {
    "empty trainer.pt": (layout.STATE_TRAINER, lambda p: p.write_bytes(b""), "cut short"),
    "truncated trainer.pt": (
        layout.STATE_TRAINER,
        lambda p: p.write_bytes(p.read_bytes()[:200]),
        "cannot be loaded",
    ),
    "a pickle": (layout.STATE_TRAINER, _pickle, "never unpickled"),
    "a list": (layout.STATE_TRAINER, _trainer_list, "no dict"),
    "wrong shapes": (layout.STATE_TRAINER, _wrong_shapes, "does not fit this model"),
    "no rng": (layout.STATE_TRAINER, _no_rng, "no RNG state"),
    "no trainer.pt": (layout.STATE_TRAINER, lambda p: p.unlink(), "is missing"),
    "trainer.pt a folder": (
        layout.STATE_TRAINER,
        lambda p: (p.unlink(), p.mkdir()),
        "cannot be loaded",
    ),
    "empty state.json": (layout.STATE_RECORD, lambda p: p.write_text(""), "no JSON"),
    "state.json a list": (layout.STATE_RECORD, lambda p: p.write_text("[1]"), "no JSON object"),
    "state.json without id": (
        layout.STATE_RECORD,
        lambda p: p.write_text(json.dumps({"version": 3, "update": 3})),
        "'id'",
    ),
    "lineage.json torn": ("lineage", lambda p: p.write_text('{"version": 3'), "no JSON"),
    "ledger.parquet torn": ("ledger", lambda p: p.write_bytes(p.read_bytes()[:50]), "ledger"),
}


@pytest.mark.parametrize("case", sorted(TORN))
def test_resume_on_a_torn_or_hostile_state_is_one_line(trained, tmp_path, case):
    """Before: 15 tracebacks, some advising weights_only=False, and an empty trainer.pt
    ended with 'aborted', exit 130. Now one line naming the file; never that advice."""
    root = tmp_path / "store"
    shutil.copytree(trained, root)
    store = Store(str(root))
    name, tamper, why = TORN[case]
    special = {"lineage": layout.lineage(store.root, 3), "ledger": layout.ledger(store.root)}
    path = Path(special.get(name) or layout.join(ST.checkpoint_dir(store, 3), name))
    tamper(path)
    with pytest.raises(GagpoError) as err:
        train(in_process(root, updates=4, resume=True))
    text = one_line(err.value, why)
    assert "weights_only=False" not in text and "weights_only` set to `False" not in text
    assert "v3" in text or name == "ledger"


def test_resume_cli_on_an_empty_trainer_pt_says_one_line_and_exits_2(trained, tmp_path):
    root = tmp_path / "store"
    shutil.copytree(trained, root)
    Path(ST.checkpoint_dir(Store(str(root)), 3), layout.STATE_TRAINER).write_bytes(b"")
    from tests.helpers.learner import run_learner, tiny_learner_args

    done = run_learner(*tiny_learner_args(root, "--resume", updates=4, batch_groups=2))
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "aborted" not in done.stderr
    assert "trainer.pt" in lines[-1] and "weights_only=False" not in done.stderr


@pytest.mark.parametrize("linked", ["trainer.pt", "checkpoints/v3"])
def test_a_symlinked_state_is_never_read(trained, tmp_path, linked):
    root = tmp_path / "store"
    shutil.copytree(trained, root)
    state = Path(ST.checkpoint_dir(Store(str(root)), 3))
    outside = tmp_path / "outside"
    if linked == "trainer.pt":
        outside.mkdir()
        shutil.move(state / layout.STATE_TRAINER, outside / layout.STATE_TRAINER)
        (state / layout.STATE_TRAINER).symlink_to(outside / layout.STATE_TRAINER)
    else:
        shutil.move(state, outside)
        state.symlink_to(outside, target_is_directory=True)
    with pytest.raises(GagpoError) as err:
        train(in_process(root, updates=4, resume=True))
    one_line(err.value, "symbolic link")


# --- FSDP resume on an object store: each rank its own shard ----------------------------------
def test_each_rank_fetches_only_its_own_optimizer_shard(tmp_path, monkeypatch):
    """A state sharded over 2 ranks in an object store (memory://): rank 1 reads the state
    record, trainer.pt and its own shard. Before: every rank downloaded the whole folder,
    every rank's shard included."""
    store = Store(f"memory://round6-{tmp_path.name}")
    remote = ST.checkpoint_dir(store, 4)
    record = {"version": 4, "parent": 3, "update": 4, "id": "abc", "parent_id": "x"}
    trainer = {
        "optimizer": {"param_groups": [{"params": ["w"], "lr": 1.0}], "shards": 2},
        "scheduler": {"last_epoch": 4},
        "rng": ST.rng_state(),
    }
    local = tmp_path / "files"
    local.mkdir()
    torch.save(trainer, local / layout.STATE_TRAINER)
    for rank in range(2):
        shard = {"state": {"w": {"step": torch.tensor(4.0)}}, "param_groups": [], "rank": rank}
        torch.save(shard, local / ST.optimizer_shard_name(rank, 2))
    (local / layout.STATE_RECORD).write_text(json.dumps(record))
    for path in local.iterdir():
        store.fs.put_file(str(path), f"{remote}/{path.name}")
    store.fs.pipe_file(f"{remote}/{layout.COMPLETE}", b"{}")
    fetched: list[str] = []
    original = store.fs.get_file

    def get_file(rpath, lpath, *args, **kwargs):
        fetched.append(Path(rpath).name)
        return original(rpath, lpath, *args, **kwargs)

    monkeypatch.setattr(store.fs, "get_file", get_file)
    monkeypatch.setattr(CK, "rank_and_world", lambda: (1, 2))
    head = ST.Head(4, 4, "abc")
    _, _, got = CK._read_state(store, 4, head, str(tmp_path / "cache"))
    assert got["optimizer"]["rank"] == 1 and got["optimizer"]["local"] is True
    assert sorted(fetched) == sorted(
        [layout.STATE_RECORD, layout.STATE_TRAINER, ST.optimizer_shard_name(1, 2)]
    )


# --- the actors' cache has a bound -------------------------------------------------------------
def test_the_cache_sweep_removes_old_copies_and_cut_fetches_and_says_their_size(tmp_path):
    cache = VersionCache(tmp_path, "s3://bucket/run")
    for version in range(6):
        folder = cache.path(version)
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"x" * 1000)
        (folder / layout.COMPLETE).write_text("{}")
    cut = Path(f"{cache.path(7)}.{'a' * 32}.partial")
    live = Path(f"{cache.path(6)}.{'b' * 32}.partial")
    for folder in (cut, live):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"y" * 500)
    old = time.time() - 7200
    os.utime(cut / "model.safetensors", (old, old))
    os.utime(cut, (old, old))
    swept = cache.sweep(5)
    assert swept.versions == (1, 2, 3) and swept.staging == 1
    assert swept.bytes == 3 * (1000 + 2) + 500
    assert sorted(p.name for p in cache.folder.iterdir()) == sorted(["v0", "v4", "v5", live.name])
    assert "removed v1, v2, v3 and 1 staging folder(s)" in swept.line()


def test_an_actor_keeps_a_bounded_cache_of_an_object_store(tmp_path):
    """The prefetcher fetches each new version of an object store (memory://) into the
    cache and, after each, sweeps it: a long run keeps v0 and the newest two, and each
    sweep is one line with the bytes removed. Before: every version stayed."""
    store = Store(f"memory://round6-cache-{tmp_path.name}")
    lines: list[str] = []
    prefetch = Prefetcher(store, str(tmp_path / "cache"), lines.append)
    held = 0
    for version in range(1, 7):
        folder = store.policies.dir(version)
        store.fs.pipe_file(f"{folder}/model.safetensors", b"w" * 4096)
        store.fs.pipe_file(f"{folder}/{layout.COMPLETE}", b"{}")
        store.policies.set_latest(version)
        deadline = time.monotonic() + 30
        while (fetched := prefetch.ready(held)) is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        held = fetched.version
    copies = sorted(p.name for p in VersionCache(tmp_path / "cache", store.url).folder.iterdir())
    assert copies == ["v5", "v6"]
    assert any(line.startswith("policy cache: removed v") and "MiB" in line for line in lines)


# --- a store written before issue 40 --------------------------------------------------------------
BEFORE_ISSUE_40 = "7b2b322"  # the commit before issue 40's first change (d30841a)


@pytest.mark.slow
def test_a_store_written_by_the_learner_before_issue_40_is_resumed(tmp_path):
    """The learner of commit 7b2b322 (a pinned `git archive`, run as a process) trains 3
    updates on a fresh store, with its own defaults (fp32 publication, a state with every
    version, written at once); today's learner resumes that store for 2 more updates and
    leaves one lineage."""
    tree = tmp_path / "old"
    tree.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", BEFORE_ISSUE_40], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    path = tmp_path / "path"
    package = path / "gagpo"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    for layer in ("schemas", "storage", "envs", "actors", "pipeline", "inspection", "learner"):
        if (tree / layer).is_dir():
            (package / layer).symlink_to(tree / layer)
    root = tmp_path / "store"
    store = Store(str(root))
    write_shards(store, 5, groups=2)
    store.policies.publish_base(str(tiny_model_dir()))
    store.policies.set_latest(0)
    from tests.helpers.learner import tiny_learner_args

    args = tiny_learner_args(root, updates=3, batch_groups=2, keep_versions=100)
    env = {**os.environ, "PYTHONPATH": str(path), "OMP_NUM_THREADS": "1"}
    old = subprocess.run(
        [sys.executable, "-m", "gagpo.learner.cli", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert old.returncode == 0, old.stderr[-3000:]
    assert store.policies.latest() == 3
    old_row = pq.read_schema(layout.metrics(store.root, 3)).names
    assert "publish_s" not in old_row  # written by the old learner (issue 40 added the column)
    assert {t.dtype for t in parameters(store.policies.dir(3)).values()} == {np.dtype("float32")}
    train(in_process(root, updates=5, resume=True, state_every=20))
    assert store.policies.latest() == 5
    assert CK.check_lineage(store) == []
    assert "publish_s" in pq.read_schema(layout.metrics(store.root, 5)).names


# --- the exact-resume kill tests, with the default state settings -----------------------------
@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted run of tests/test_resume_lineage.py: the reference weights."""
    from tests.helpers.lineage import UPDATES, B

    root = tmp_path_factory.mktemp("straight") / "store"
    store = lineage_store(root)
    default = LearnerConfig.model_fields["state_every"].default
    train(
        in_process(
            root,
            updates=UPDATES,
            batch_groups=B,
            max_staleness=100,
            idle_timeout_s=1.0,
            state_every=default,
        )
    )
    return store


def lineage_store(root: Path) -> Store:
    from tests.helpers.lineage import UPDATES, B

    store = Store(str(root))
    write_shards(store, UPDATES, groups=B)
    store.policies.publish_base(str(tiny_model_dir()))
    store.policies.set_latest(0)
    return store


@pytest.mark.parametrize(
    ("hold", "extra"),
    [
        ("backward:8", ()),  # the defaults: a state every 20 updates, written by a thread
        pytest.param("backward:8", ("--state-every", "3"), marks=pytest.mark.slow),
        pytest.param("checkpoint:6", ("--state-every", "3"), marks=pytest.mark.slow),
    ],
)
def test_kill_then_resume_with_the_default_state_settings(straight, tmp_path, hold, extra):
    """tests/test_resume_lineage.py's kills, with states as the learner writes them by
    default (every `state_every` updates, by a thread; not `--state-every 1
    --no-state-async`): one lineage, every group trained once; the resumed run says which
    optimiser state it took, and is the uninterrupted run bit for bit when that state is
    LATEST's own."""
    from tests.helpers.lineage import UPDATES, assert_one_lineage, kill_at, lineage_args

    store = lineage_store(tmp_path / "store")
    kill_at(tmp_path / "store", hold, tmp_path, *extra)
    latest = store.policies.latest()
    from tests.helpers.learner import run_learner

    done = run_learner(*lineage_args(tmp_path / "store", "--resume", *extra))
    assert done.returncode == 0, done.stderr[-3000:]
    assert_one_lineage(store)
    notes = [line for line in done.stderr.splitlines() if line.startswith("--resume:")]
    if not extra:
        assert any(f"no complete training state at or before v{latest}" in n for n in notes)
    elif not notes:  # LATEST's own state: the uninterrupted lineage, bit for bit
        a = parameters(store.policies.dir(UPDATES))
        b = parameters(straight.policies.dir(UPDATES))
        for name in a:
            np.testing.assert_allclose(a[name], b[name], atol=1e-6, rtol=0, err_msg=name)
    else:
        assert any("optimiser moments of v" in n for n in notes), notes
