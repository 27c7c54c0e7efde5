"""Issue 39 (reliability round 5), the store: a store's own files never reach outside it.

Every hostile archive of the round, turned into a test: manifest entries that climb out of
the root, name an absolute path, a glob, a URL or a megabyte; a segment or the segments
folder that is a symbolic link; a forged moved list; segments that are truncated, of a
foreign schema or of wrong types. After each, the file outside is byte-identical, its
rows never appear, and every reader (the SQL views under `gagpo sql`, `gagpo view` and
`gagpo report`; the archive reader of reports, credit and evaluation; `gagpo advantages
--store`; the learner's replay feed; `gagpo compact`) refuses with one line or, the SQL
views, skips the file with one warning line (docs/store.md: "A store's files never reach
outside it").
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from gagpo.actors.throttle import Throttle
from gagpo.inspection.sql import close_store_db, open_store_db, run_query
from gagpo.learner.compact import compact_store
from gagpo.learner.config import CompactionSettings
from gagpo.learner.feed import Feed, Ledger, pipeline_advantages
from gagpo.pipeline.config import GagpoConfig
from gagpo.pipeline.recompute import recompute_store
from gagpo.schemas import columns as C
from gagpo.schemas import layout
from gagpo.schemas.errors import GagpoError
from gagpo.storage.archive import (
    cleared_path,
    manifest_path,
    moved_json,
    moved_path,
    read_ledger,
    read_manifest,
    read_steps_table,
    segment_path,
)
from gagpo.storage.compaction import compact
from gagpo.storage.confine import OutsideStoreError
from gagpo.storage.store import Store
from tests.helpers.steps import make_steps

ROOT = Path(__file__).resolve().parents[1]
GROUP_SIZE = 3
# From archive/segments/ (or advantages/<tag>/) of BASE/a/b/store up to BASE: 5 levels.
CLIMB = "../../../../../victim/precious"


# --- building the hostile stores -----------------------------------------------------------
def fill(store: Store, count: int, run_id: str = "ra", first: int = 0) -> list:
    """`count` shards of `run_id`, two groups each (shard ids <run_id>000, …)."""
    return [
        store.write_shard(
            make_steps(run_id=run_id, shard_id=f"{run_id}{i:03d}", groups=2, group_size=GROUP_SIZE),
            group_size=GROUP_SIZE,
        )
        for i in range(first, first + count)
    ]


def segment_bytes(run_id: str, shard_id: str) -> bytes:
    """A file that is a valid segment by every check: the victim's rows look like ours."""
    table = make_steps(run_id=run_id, shard_id=shard_id, groups=2, group_size=GROUP_SIZE)
    table = table.select(list(C.STEPS_COLUMNS)).cast(C.STEPS_SCHEMA)
    metadata = {
        C.META_SCHEMA_VERSION: C.STEPS_SCHEMA_VERSION.encode(),
        C.META_GROUP_SIZE: str(GROUP_SIZE).encode(),
    }
    buffer = io.BytesIO()
    pq.write_table(table.replace_schema_metadata(metadata), buffer)
    return buffer.getvalue()


@pytest.fixture
def archived(tmp_path: Path) -> tuple[Store, Path]:
    """A store at BASE/a/b/store, 4 shards compacted into one segment and 1 in the inbox,
    and BASE/victim/precious.parquet: someone else's file, valid steps of run `victim`."""
    root = tmp_path / "a" / "b" / "store"
    store = Store(str(root))
    compact(store, fill(store, 4), None)
    fill(store, 1, first=4)
    victim = tmp_path / "victim" / "precious.parquet"
    victim.parent.mkdir()
    victim.write_bytes(segment_bytes("victim", "v000"))
    return store, victim


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def edit_manifest(store: Store, change) -> Path:
    """Rewrite the newest manifest in place with `change(body)` (a hostile writer)."""
    path = Path(manifest_path(store, read_manifest(store).generation))
    body = json.loads(path.read_bytes())
    change(body)
    path.write_text(json.dumps(body))
    return path


def sql_runs(store: Store) -> set[str]:
    con = open_store_db(store)
    try:
        return set(run_query(con, "SELECT DISTINCT run_id FROM steps").column(0).to_pylist())
    finally:
        close_store_db(con)


def replay(store: Store) -> list[str]:
    """The learner's replay feed over `store`: the group ids of every batch."""
    feed = Feed(
        Store(str(Path(store.root).parent / "learner-store")),
        Ledger(),
        pipeline_advantages(GagpoConfig()),
        batch_groups=2,
        max_staleness=None,
        source=store,
        follow=False,
    )
    groups = []
    while (batch := feed.next_batch(0)) is not None:
        groups += [g.group_id for g in batch.groups]
    return groups


def readers(store: Store):
    """Every reader of the archive, in-process, each as the CLI that runs it."""
    url = store.url
    return {
        "report/credit/evaluate (read_steps_table)": lambda: read_steps_table(store),
        "sql/view/report (open_store_db)": lambda: sql_runs(store),
        "advantages --store": lambda: recompute_store(url, None, GagpoConfig()),
        "replay": lambda: replay(store),
        "compact": lambda: compact_store(url, None, True, CompactionSettings(), echo=lambda *_: 0),
    }


def one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text and "Traceback" not in text, text
    return text


# --- manifest entries that leave the store -------------------------------------------------
def hostile_ids(victim: Path) -> dict[str, str]:
    return {
        "climbs out": CLIMB,
        "absolute": str(victim.with_suffix("")),
        "a glob": "[a-z]*/../" + CLIMB,
        "../victim/*": "../victim/*",
        "a URL": f"file://{victim.with_suffix('')}",
        "1 MB": "x" * 2**20,
    }


@pytest.mark.parametrize(
    "case", ["climbs out", "absolute", "a glob", "../victim/*", "a URL", "1 MB"]
)
def test_a_segment_id_that_names_a_file_outside_is_refused_by_every_reader(archived, case):
    store, victim = archived
    before = digest(victim)
    forged = hostile_ids(victim)[case]
    where = edit_manifest(store, lambda body: body["segments"][0].update(id=forged))
    for name, read in readers(store).items():
        with pytest.raises(GagpoError) as caught:
            read()
        line = one_line(caught.value)
        assert str(where) in line and "segment 0" in line, (name, line)
    assert digest(victim) == before
    assert sorted(os.listdir(victim.parent)) == ["precious.parquet"]


@pytest.mark.parametrize(
    "moved_file", ["../../../../x", "/etc/passwd", "0000000001-a/b.moved.json"]
)
def test_a_moved_file_outside_the_manifest_folder_is_never_opened(archived, moved_file):
    store, _ = archived
    generation = read_manifest(store).generation
    Path(cleared_path(store, generation)).unlink()  # the moved list matters again
    where = edit_manifest(store, lambda body: body.update(moved_file=moved_file))
    for name, read in readers(store).items():
        with pytest.raises(GagpoError) as caught:
            read()
        line = one_line(caught.value)
        assert str(where) in line and "moved_file" in line, (name, line)


# --- symbolic links ---------------------------------------------------------------------------
def test_a_segment_that_is_a_symbolic_link_is_never_followed(archived):
    store, victim = archived
    (segment,) = read_manifest(store).segments
    path = Path(segment_path(store, segment.id))
    path.unlink()
    path.symlink_to(victim)
    before = digest(victim)
    for name, read in readers(store).items():
        if name.startswith("sql"):  # the views skip it, with one warning line
            assert "victim" not in read()
            continue
        with pytest.raises(GagpoError) as caught:
            read()
        assert "symbolic link" in one_line(caught.value), name
    assert digest(victim) == before and path.is_symlink()


def test_a_segments_folder_that_is_a_symbolic_link_is_never_written_nor_emptied(archived, tmp_path):
    store, _ = archived
    folder = Path(layout.segments_dir(store.root))
    elsewhere = tmp_path / "elsewhere"
    shutil.move(folder, elsewhere)
    folder.symlink_to(elsewhere)
    for name in ("01aaaaaaaaaaaaaaaaaaaaaaaa", "01bbbbbbbbbbbbbbbbbbbbbbbb", "other"):
        (elsewhere / f"{name}.parquet").write_bytes(b"someone else's")
    before = {p.name: digest(p) for p in elsewhere.iterdir()}
    fill(store, 2, first=10)
    with pytest.raises(OutsideStoreError) as caught:
        compact_store(store.url, None, True, CompactionSettings(), echo=lambda *_: 0)
    assert "symbolic link" in one_line(caught.value)
    assert {p.name: digest(p) for p in elsewhere.iterdir()} == before  # nothing removed, added


def test_store_reads_commits_and_removes_only_its_own_files(tmp_path):
    store = Store(str(tmp_path / "store"))
    fill(store, 1)
    outside = tmp_path / "outside.parquet"
    outside.write_bytes(b"precious")
    link = Path(store.path("shards", "link.parquet"))
    link.symlink_to(outside)
    for path in (store.path("..", "outside.parquet"), str(outside), str(link)):
        with pytest.raises(OutsideStoreError):
            store.read_bytes(path)
        with pytest.raises(OutsideStoreError):
            store.commit_bytes(path, b"overwritten")
    for path in (store.path("..", "outside.parquet"), str(outside)):
        with pytest.raises(OutsideStoreError):
            store.remove_files([store.shard_path("ra", "ra000"), path], "a test")
    assert outside.read_bytes() == b"precious"
    assert store.exists(store.shard_path("ra", "ra000"))  # nothing removed when one is refused
    store.remove_files([str(link)], "a link")  # a link is removed as itself
    assert not link.is_symlink() and outside.read_bytes() == b"precious"
    with pytest.raises(GagpoError, match="not a file id"):
        layout.segment(store.root, CLIMB)
    # a file of the inbox whose name is no id is not a shard: listed by no reader
    Path(store.path("shards", "run=ra", "a[1] b.parquet")).write_bytes(b"not ours")
    assert [ref.shard_id for ref in store.list_shards()] == ["ra000"]


@pytest.mark.parametrize("reader", ["learner", "compact"])
def test_links_in_the_inbox_are_never_followed(tmp_path, reader):
    """A shard that links another store's shard, and a run folder that links another
    store's run folder: the learner's feed and a compaction never read them (no group of
    run `l` is trained or archived); the link is quarantined as itself, what it names stays
    byte-identical where it is."""
    store = Store(str(tmp_path / "store"))
    fill(store, 2)
    other = Store(str(tmp_path / "other"))
    theirs = fill(other, 2, run_id="l")
    before = {ref.path: digest(Path(ref.path)) for ref in theirs}
    Path(store.shard_path("ra", "l000")).symlink_to(theirs[0].path)
    Path(store.path("shards", "run=l")).symlink_to(Path(theirs[1].path).parent)
    if reader == "learner":
        feed = Feed(
            store, Ledger(), pipeline_advantages(GagpoConfig()), batch_groups=2, max_staleness=None
        )
        feed.follow = False
        runs = []
        while (batch := feed.next_batch(0)) is not None:
            runs += [g.run_id for g in batch.groups]
    else:
        compact_store(store.url, None, True, CompactionSettings(), echo=lambda *_: 0)
        runs = read_steps_table(store, [C.RUN_ID])[C.RUN_ID].to_pylist()
    assert set(runs) == {"ra"}
    assert {p: digest(Path(p)) for p in before} == before
    (record,) = store.quarantined()
    assert record["original_path"] == store.shard_path("ra", "l000")
    assert not Path(store.shard_path("ra", "l000")).is_symlink()  # moved: the link itself


# --- a forged moved list ------------------------------------------------------------------------
@pytest.mark.parametrize("everything", [False, True])
def test_a_forged_moved_list_deletes_no_unconsumed_shard(archived, everything):
    """Another run's 4 unconsumed shards, named by the newest generation's moved list as if
    a killed compaction had left them: the next compaction leaves every one of their groups
    in the store (in the inbox, or with --all moved into a segment)."""
    store, _ = archived
    others = fill(store, 4, run_id="rb")
    want = set(read_steps_table(store, [C.GROUP_ID])[C.GROUP_ID].to_pylist())
    bytes_before = {ref.path: Path(ref.path).read_bytes() for ref in others}
    manifest = read_manifest(store)
    Path(moved_path(store, manifest.moved_file)).write_bytes(
        moved_json([ref.shard_id for ref in others])
    )
    Path(cleared_path(store, manifest.generation)).unlink()
    compact_store(store.url, None, everything, CompactionSettings(), echo=lambda *_: 0)
    assert set(read_steps_table(store, [C.GROUP_ID])[C.GROUP_ID].to_pylist()) == want
    if not everything:  # unconsumed: still in the inbox, byte-identical
        assert {p: Path(p).read_bytes() for p in bytes_before} == bytes_before


# --- bad segments ---------------------------------------------------------------------------------
def bad_segment(case: str, good: bytes) -> bytes:
    if case == "truncated":
        return good[: len(good) // 2]
    table = pq.ParquetFile(pa.BufferReader(good)).read()
    if case == "foreign schema":
        table = pa.table({"x": pa.array(range(table.num_rows))})
    else:  # the contract's columns, reward as text: junk rows in SQL before
        i = table.schema.get_field_index(C.REWARD)
        reward = pc.cast(table[C.REWARD], pa.string())
        table = table.set_column(i, pa.field(C.REWARD, pa.string()), reward)
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize("case", ["truncated", "foreign schema", "wrong types"])
def test_a_bad_segment_is_refused_by_every_reader_and_skipped_by_sql(archived, case, capsys):
    store, _ = archived
    (segment,) = read_manifest(store).segments
    path = Path(segment_path(store, segment.id))
    path.write_bytes(bad_segment(case, path.read_bytes()))
    before = digest(path)
    fill(store, 1, first=20)  # a compaction would extend the (bad) open segment
    for name, read in readers(store).items():
        if name.startswith("sql"):
            assert read() == {"ra"}  # the inbox's two shards; nothing of the bad segment
            assert segment.id in capsys.readouterr().err
            continue
        with pytest.raises(GagpoError) as caught:
            read()
        line = one_line(caught.value)
        assert f"archive segment {path}" in line, (name, line)
    assert digest(path) == before and store.quarantined() == []


# --- backpressure after gagpo compact --all ----------------------------------------------------
def test_backpressure_counts_archived_groups_no_learner_consumed(tmp_path):
    store = Store(str(tmp_path / "store"))
    refs = fill(store, 3)
    throttle = Throttle(store)
    assert throttle.backlog().groups == 6
    compact_store(store.url, None, True, CompactionSettings(), echo=lambda *_: 0)
    assert store.list_shards() == []
    assert throttle.backlog().groups == 6  # archived, still waiting for a learner
    fill(store, 1, first=3)
    assert throttle.backlog().groups == 8
    # a learner consumes the archived groups of one shard: its tail records them
    store.write_parquet(ledger_rows(store, refs[:1]), layout.ledger(store.root), {})
    assert throttle.backlog().groups == 6


def ledger_rows(store: Store, refs: list) -> pa.Table:
    """Ledger rows (update 1, trained) of every group of `refs`, wherever they are now."""
    steps = read_steps_table(store, [C.GROUP_ID, C.SHARD_ID])
    rows = [
        {
            C.RUN_ID: "ra",
            C.SHARD_ID: ref.shard_id,
            C.GROUP_ID: group,
            C.SHARD_GROUPS: 2,
            C.POLICY_VERSION: 0,
            C.LEDGER_UPDATE: 1,
            C.LEDGER_LEARNER_VERSION: 0,
            C.LEDGER_STATUS: "trained",
        }
        for ref in refs
        for group in sorted(
            set(steps.filter(pc.equal(steps[C.SHARD_ID], ref.shard_id))[C.GROUP_ID].to_pylist())
        )
    ]
    return pa.Table.from_pylist(rows, schema=C.LEDGER_SCHEMA)


def test_a_bad_ledger_part_is_refused_with_one_line(tmp_path):
    store = Store(str(tmp_path / "store"))
    refs = fill(store, 2)
    compact(store, refs, ledger_rows(store, refs))
    (segment,) = read_manifest(store).segments
    part = Path(layout.ledger_part(store.root, segment.id))
    part.write_bytes(part.read_bytes()[:100])
    with pytest.raises(GagpoError) as caught:
        read_ledger(store)
    assert f"archive ledger part {part} cannot be used" in one_line(caught.value)


# --- the command lines: one line, nothing outside touched --------------------------------------
def test_the_clis_refuse_a_hostile_manifest_with_one_line(archived):
    store, victim = archived
    before = digest(victim)
    edit_manifest(store, lambda body: body["segments"][0].update(id=CLIMB))
    for command in (
        ["advantages", "--store", store.url],
        ["compact", "--store", store.url, "--all"],
    ):
        result = subprocess.run(
            [sys.executable, "-m", "gagpo.workflows.cli", *command],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=300,
        )
        assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
        (line,) = [x for x in result.stderr.splitlines() if "segment 0" in x]
        assert "not a file id" in line
    assert digest(victim) == before
