"""`gagpo.open_store`: the store as Polars frames and SQL, from Python in one call
(inspection/library.py). Its frames must be the rows `gagpo sql` prints, on a local store
and on S3, mid-compaction included, each group exactly once.

The store: 8 shards of 1–2 groups (G = 3), advantage tables of two tags, a ledger of 4
updates and their learner metrics; the first 5 shards compacted, and then a compaction of
the other 3 stopped at one of its crash points (storage/compaction.py): its segment
written but not committed, or committed with the inbox not yet cleared. Either way each
group is in two files, of which readers must read one.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import polars as pl
import pyarrow as pa
import pytest
from click.testing import CliRunner
from polars.testing import assert_frame_equal

import gagpo
from gagpo.inspection.cli import inspect
from gagpo.schemas import columns as C
from gagpo.schemas import layout
from gagpo.schemas.errors import GagpoError
from gagpo.storage import compaction
from gagpo.storage.archive import read_manifest, step_files
from gagpo.storage.store import Store
from tests.helpers.steps import make_steps

SHARDS, ARCHIVED, G = 8, 5, 3
TAGS = ("gagpo", "grpo")
PHASES = ("compact-written", "compact-committed")
DOCS = Path(__file__).resolve().parents[1] / "docs"


class Stopped(Exception):
    """A compaction stopped at a crash point, as a SIGKILL there would leave the store."""


def shard(i: int) -> pa.Table:
    return make_steps(run_id=f"r{i % 2}", shard_id=f"s{i:03d}", groups=1 + i % 2, group_size=G)


def update_of(i: int) -> int:
    """The learner update that consumed shard i's groups: two shards per update."""
    return i // 2 + 1


def ledger_rows(tables: list[pa.Table]) -> pa.Table:
    rows = []
    for i, table in enumerate(tables):
        groups = sorted(set(table[C.GROUP_ID].to_pylist()))
        rows += [
            {
                C.RUN_ID: f"r{i % 2}",
                C.SHARD_ID: f"s{i:03d}",
                C.GROUP_ID: group,
                C.SHARD_GROUPS: len(groups),
                C.POLICY_VERSION: 0,
                C.LEDGER_UPDATE: update_of(i),
                C.LEDGER_LEARNER_VERSION: update_of(i) - 1,
                C.LEDGER_STATUS: "trained",
            }
            for group in groups
        ]
    return pa.Table.from_pylist(rows, schema=C.LEDGER_SCHEMA)


def write_advantages(store: Store, table: pa.Table, shard_id: str) -> None:
    """Per tag an advantage table of the shard's steps, values that differ by tag."""
    keys = table.select([C.GROUP_ID, C.TRAJ_ID, C.STEP, C.STATE_KEY])
    for k, tag in enumerate(TAGS):
        values = pa.array([float(k + step) for step in keys[C.STEP].to_pylist()], pa.float64())
        store.write_parquet(
            keys.append_column(C.ADVANTAGE, values), store.advantages_path(tag, shard_id), {}
        )


def write_metrics(store: Store, update: int) -> None:
    row = {"update": update, "version": update, "loss": 1.0 / update, "kl_ref": 0.01 * update}
    schema = pa.schema([C.LEARNER_METRICS_SCHEMA.field(name) for name in row])
    table = pa.Table.from_pylist([row], schema=schema)
    store.write_parquet(table, layout.metrics(store.root, update), {})


def mid_compaction_store(url: str, phase: str) -> tuple[Store, pa.Table]:
    """The store of the module docstring, its last compaction stopped at `phase`; returns
    it and every step written."""
    store = Store(url, skip_instance_cache=True)
    tables = [shard(i) for i in range(SHARDS)]
    refs = [store.write_shard(t, group_size=G) for t in tables]
    for table, ref in zip(tables, refs, strict=True):
        write_advantages(store, table, ref.shard_id)
    ledger = ledger_rows(tables)
    store.write_parquet(ledger, layout.ledger(store.root), {})
    for update in sorted({update_of(i) for i in range(SHARDS)}):
        write_metrics(store, update)
    archived = ledger.slice(0, sum(len(set(t[C.GROUP_ID].to_pylist())) for t in tables[:ARCHIVED]))
    compaction.compact(store, refs[:ARCHIVED], archived)

    def stop_at(reached: str) -> None:
        if reached == phase:
            raise Stopped(phase)

    with pytest.MonkeyPatch.context() as patch, pytest.raises(Stopped):
        patch.setattr(compaction, "fault_point", stop_at)
        compaction.compact(store, refs[ARCHIVED:], None)
    return store, pa.concat_tables(tables)


@pytest.fixture(scope="module", params=PHASES)
def stopped(request, tmp_path_factory) -> tuple[Store, pa.Table, str]:
    """A local store mid-compaction, per crash point: (store, every step written, phase)."""
    root = tmp_path_factory.mktemp(request.param) / "store"
    return (*mid_compaction_store(str(root), request.param), request.param)


@pytest.fixture(scope="module")
def committed(tmp_path_factory) -> tuple[Store, pa.Table]:
    """A local store whose last compaction committed and did not clear the inbox."""
    return mid_compaction_store(str(tmp_path_factory.mktemp("committed") / "store"), PHASES[1])


def assert_mid_compaction(store: Store, phase: str) -> None:
    """The stopped compaction left its groups in two files: the state this test is about."""
    segments = {p.rsplit("/", 1)[-1] for p in store.glob(store.path("archive", "segments", "*"))}
    files = step_files(store)
    listed = {f"{s.id}.parquet" for s in files.segments}
    inbox = store.list_shards()
    assert len(inbox) == SHARDS - ARCHIVED  # the stopped compaction removed no shard
    if phase == "compact-written":  # a segment is written that no manifest names
        assert read_manifest(store).generation == 1 and segments - listed
    else:  # committed: the manifest names the new segment, the moved shards are still there
        assert read_manifest(store).generation == 2 and not files.shards


def cli(*args: str) -> pl.DataFrame:
    """`gagpo sql ... --format parquet` as a DataFrame: the CLI's answer."""
    out = Path(tempfile.mkdtemp()) / "answer.parquet"
    result = CliRunner().invoke(
        inspect, ["sql", *args, "--format", "parquet", "--out", str(out)], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    return pl.read_parquet(out)


def assert_same_rows(got: pl.DataFrame, want: pl.DataFrame) -> None:
    """The same columns (names, order, types) and the same rows, in any order."""
    assert got.schema == want.schema
    assert got.height == want.height
    assert_frame_equal(got, want, check_row_order=False)


def assert_each_group_once(steps: pl.DataFrame, written: pa.Table) -> None:
    want = pl.from_arrow(written)
    assert steps.height == want.height
    assert steps.select(C.TRAJ_ID, C.STEP).is_duplicated().sum() == 0
    assert set(steps[C.GROUP_ID]) == set(want[C.GROUP_ID])


# --- each group once, mid-compaction ---------------------------------------------------
def test_each_group_once_on_a_store_mid_compaction(stopped):
    store, written, phase = stopped
    assert_mid_compaction(store, phase)
    reader = gagpo.open_store(store.url)
    assert_each_group_once(reader.steps().collect(), written)
    groups = reader.groups().collect()
    assert groups.height == len(set(written[C.GROUP_ID].to_pylist()))
    assert groups["rollouts"].to_list() == [G] * groups.height
    assert reader.trajectories().collect()[C.TRAJ_ID].n_unique() == groups.height * G
    for tag in TAGS:
        assert reader.advantages(tag).collect().height == written.num_rows
    reader.close()


# --- the frames are the CLI's answers ------------------------------------------------------
FRAMES = {
    "steps": lambda r: r.steps(),
    "groups": lambda r: r.groups(),
    "trajectories": lambda r: r.trajectories(),
    "learner_metrics": lambda r: r.learner_metrics(),
    **{f"advantages:{tag}": (lambda r, tag=tag: r.advantages(tag)) for tag in TAGS},
}


def cli_query(name: str) -> str:
    view, _, tag = name.partition(":")
    return f"SELECT * FROM {view}" + (f" WHERE estimator = '{tag}'" if tag else "")


def assert_frames_are_the_cli(url: str, *options: str, **open_options) -> None:
    with gagpo.open_store(url, **open_options) as reader:
        for name, frame in FRAMES.items():
            got = frame(reader).collect()
            assert got.height > 0, name
            assert_same_rows(got, cli("--store", url, *options, cli_query(name)))


def test_frames_equal_gagpo_sql_on_a_local_store(stopped):
    store, _, _ = stopped
    assert_frames_are_the_cli(store.url)


def test_steps_equal_gagpo_sql_on_s3(s3_endpoint, tmp_path):
    url = f"s3://gagpo/{tmp_path.name}"
    store, written = mid_compaction_store(url, "compact-committed")
    assert_mid_compaction(store, "compact-committed")
    with gagpo.open_store(url) as reader:
        steps = reader.steps().collect()
    assert_each_group_once(steps, written)
    assert_same_rows(steps, cli("--store", url, "SELECT * FROM steps"))


def test_as_of_update_is_the_clis(committed):
    store, _ = committed
    ledger = ledger_rows([shard(i) for i in range(SHARDS)])
    for update in (1, 3):
        want = {row[C.GROUP_ID] for row in ledger.to_pylist() if row[C.LEDGER_UPDATE] <= update}
        with gagpo.open_store(store.url, as_of_update=update) as reader:
            assert set(reader.steps().collect()[C.GROUP_ID]) == want
            assert reader.learner_metrics().collect()["update"].max() == update
    assert_frames_are_the_cli(store.url, "--as-of-update", "3", as_of_update=3)


# --- the documented example -----------------------------------------------------------------
def documented_example(doc: str, heading: str) -> str:
    """The first Python block after `heading` in docs/`doc`."""
    text = (DOCS / doc).read_text()
    section = text[text.index(heading) :]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


def test_the_documented_example_answers_as_the_cli(stopped):
    store, _, _ = stopped
    example = documented_example("store.md", "**Reading a store from Python.**")
    assert len([line for line in example.splitlines() if line.strip()]) <= 3  # three lines
    scope: dict = {}
    exec(example.replace('"runs/a"', repr(store.url)), scope)
    assert_same_rows(scope["steps"], cli("--store", store.url, "SELECT * FROM steps"))
    assert_same_rows(scope["groups"], cli("--store", store.url, "SELECT * FROM groups"))


def test_the_inspect_guide_example_answers_as_the_cli(committed):
    store, _ = committed
    example = documented_example("inspect.md", "## From Python")
    scope: dict = {}
    exec(example.replace('"runs/a"', repr(store.url)), scope)
    wins = cli("--store", store.url, 'SELECT group_id, "return" FROM trajectories WHERE success')
    assert_same_rows(scope["wins"], wins)
    steps = cli("--store", store.url, "SELECT * FROM advantages WHERE estimator = 'gagpo'")
    assert scope["credit"].height == steps.height > 0


# --- reading together, the sandbox, one-line errors -------------------------------------------
def test_frames_join_and_sql_runs_while_they_are_read(committed):
    store, written = committed
    reader = gagpo.open_store(store.url)
    joined = (
        reader.steps()
        .join(reader.groups(), on=C.GROUP_ID)
        .join(reader.advantages("grpo"), on=[C.TRAJ_ID, C.STEP])
        .collect()
    )
    assert joined.height == written.num_rows
    counts = reader.sql("SELECT count(*) AS n FROM steps WHERE step >= ?", [1])
    assert counts["n"].to_list() == [sum(s >= 1 for s in written[C.STEP].to_pylist())]
    assert reader.tags() == sorted(TAGS)
    # a frame opened and collected in one line: the reader need not be kept
    assert gagpo.open_store(store.url).steps().collect().height == written.num_rows


def test_sql_is_gagpo_sqls_sandbox(committed, tmp_path):
    store, _ = committed
    target = tmp_path / "leak.csv"
    with gagpo.open_store(store.url) as reader:
        for query in (
            f"COPY (SELECT * FROM steps) TO '{target}'",
            f"SELECT * FROM read_csv('{tmp_path / 'elsewhere.csv'}')",
            "SET enable_external_access = true",
            f"ATTACH '{tmp_path / 'other.db'}'",
        ):
            with pytest.raises(GagpoError, match=r"query (refused|failed)") as caught:
                reader.sql(query)
            assert "\n" not in str(caught.value)
    assert not target.exists() and not (tmp_path / "other.db").exists()


@pytest.mark.parametrize(
    ("call", "says"),
    [
        (lambda url: gagpo.open_store(url + "-missing"), "does not exist"),
        (lambda url: gagpo.open_store("nosuch://bucket/run"), "cannot be opened"),
        (lambda url: gagpo.open_store(""), "is not a path"),
        (lambda url: gagpo.open_store(url, as_of_update=-1), "is not an update"),
        (lambda url: gagpo.open_store(url, as_of_update=99), "out of range"),
        (lambda url: gagpo.open_store(url, timeout_s=-1), "not a time limit"),
        (lambda url: gagpo.open_store(url, memory_limit="lots"), "not a size"),
        (lambda url: gagpo.open_store(url, gamma=2), "out of range"),
        (lambda url: gagpo.open_store(url).advantages("nope"), "accepted: gagpo, grpo"),
        (lambda url: gagpo.open_store(url).view("nope"), "accepted: steps"),
    ],
)
def test_user_mistakes_are_one_line(committed, call, says):
    store, _ = committed
    with pytest.raises(GagpoError, match=says) as caught:
        call(store.url)
    assert "\n" not in str(caught.value)


def test_a_closed_reader_says_so(committed):
    store, _ = committed
    reader = gagpo.open_store(store.url)
    reader.close()
    with pytest.raises(GagpoError, match="closed"):
        reader.steps()
    assert "closed" in repr(reader)


def test_a_reader_opened_with_no_arguments_bounds_queries_as_gagpo_sql_does(committed):
    """One default each for the discount and the query time limit: gagpo sql's --gamma and
    --timeout, the reader's and `Limits`' (inspection/arguments.py)."""
    import inspect as pyinspect

    from gagpo.inspection.sql import Limits

    store, _ = committed
    sql = inspect.commands["sql"]
    flags = {p.name: p.default for p in sql.params}
    reader = gagpo.open_store(store.url)
    defaults = pyinspect.signature(gagpo.open_store).parameters
    assert reader.limits == Limits() and Limits().timeout_s == flags["timeout_s"]
    assert defaults["timeout_s"].default == flags["timeout_s"]
    assert defaults["gamma"].default == flags["gamma"]
    reader.close()
