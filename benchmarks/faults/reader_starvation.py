"""A SQL reader beside a compactor that never rests: how many reads answer, how many fail
(issue 46; benchmarks/RESULTS.md, round 6, "a reader under continuous compaction").

    python benchmarks/faults/reader_starvation.py --seconds 60 --request-s 0.01
    python benchmarks/faults/reader_starvation.py --request-s 0.01 --before 8ce7a41~1
    python benchmarks/faults/reader_starvation.py --request-s 0.01 --defer

One local store (an archive of three shards, an inbox of three; as the round-6 stress
test prepares it, tests/test_reliability_round6_compaction.py): an actor thread commits a one-group shard every 20 ms, a compactor thread
compacts every inbox shard but the newest again and again without a pause (each merging
the open segment), and one reader thread runs the SQL views' group ids again and again.
Each store request of the reader (listing, read, footer read) first sleeps `--request-s`,
as an object store's requests take time; the writers' do not. Prints the answers, the
failures (with the first three lines), the compactions, the longest answer, and how many
answers lost a group committed before they began or counted a step twice (the reader's
guarantee: always 0). `--defer` compacts with `defer_removal` (storage/compaction.py:
what a generation superseded is removed when the next one commits).
`--before COMMIT` runs the reader's `step_sources` of COMMIT's inspection/sql_sources.py
instead of this tree's (the rest is this tree's).
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.append(str(ROOT))  # after PYTHONPATH: `--before`-style runs of another tree

import pyarrow.parquet as pq  # noqa: E402

from gagpo.inspection import sql as sql_module  # noqa: E402
from gagpo.inspection.sql import query_store  # noqa: E402
from gagpo.storage.compaction import compact  # noqa: E402
from gagpo.storage.store import Store  # noqa: E402
from tests.helpers.compacting import commit_shard, prepared  # noqa: E402

_role = threading.local()  # "reader" in the reader's thread


# The stress test's query: the steps view's rows, steps and groups, the advantages view's.
COUNTS = (
    "SELECT (SELECT count(*) FROM steps) AS n,"
    " (SELECT count(DISTINCT traj_id || ':' || step) FROM steps) AS d,"
    " (SELECT list(DISTINCT group_id) FROM steps) AS ids,"
    " (SELECT count(*) FROM advantages) AS a"
)


def use_step_sources_of(commit: str) -> None:
    """The SQL views open their steps with `step_sources` of COMMIT's sql_sources.py."""
    text = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{commit}:inspection/sql_sources.py"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    path = Path(tempfile.mkdtemp(prefix="sql-sources-")) / "old_sql_sources.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("old_sql_sources", path)
    old = importlib.util.module_from_spec(spec)
    sys.modules["old_sql_sources"] = old  # dataclasses look their module up
    spec.loader.exec_module(old)
    sql_module.src.step_sources = old.step_sources


def slow_reader_requests(seconds: float) -> None:
    """Every listing, read and footer read of the thread in the role "reader" sleeps first."""

    def slowly(original):
        def wrapper(*args, **kwargs):
            if getattr(_role, "name", None) == "reader":
                time.sleep(seconds)
            return original(*args, **kwargs)

        return wrapper

    for name in ("glob", "read_bytes", "exists"):
        setattr(Store, name, slowly(getattr(Store, name)))
    pq.read_schema = slowly(pq.read_schema)


def run(seconds: float, defer: bool = False) -> dict:
    url = tempfile.mkdtemp(prefix="starvation-") + "/store"
    store, expected = prepared(url)
    committed = expected.groups
    lock, stop = threading.Lock(), threading.Event()
    counts = {
        "answers": 0,
        "failed": 0,
        "lost": 0,
        "doubled": 0,
        "compactions": 0,
        "longest_s": 0.0,
    }
    errors: list[str] = []

    def actor() -> None:
        number = 100
        while not stop.is_set():
            groups = commit_shard(store, number)
            with lock:
                committed.update(groups)
            number += 1
            time.sleep(0.02)

    def compactor() -> None:
        while not stop.is_set():
            inbox = store.list_shards()
            if len(inbox) > 1:
                options = {"defer_removal": True} if defer else {}  # none: any commit's code
                result = compact(store, inbox[:-1], None, **options)
                counts["compactions"] += result.generation is not None

    def reader() -> None:
        _role.name = "reader"
        while not stop.is_set():
            with lock:
                before = set(committed)
            started = time.monotonic()
            try:
                answer = query_store(url, COUNTS).to_pylist()[0]
                seen = set(answer["ids"] or [])
            except Exception as exc:  # what a user would get: counted, first lines kept
                counts["failed"] += 1
                text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
                errors.append(f"after {time.monotonic() - started:.0f} s: {text}"[:400])
                continue
            counts["answers"] += 1
            counts["lost"] += bool(before - seen)
            counts["doubled"] += answer["n"] != answer["d"]
            counts["longest_s"] = max(counts["longest_s"], round(time.monotonic() - started, 1))

    threads = [threading.Thread(target=f) for f in (actor, compactor, reader)]
    for thread in threads:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join()
    return {**counts, "errors": errors[:3]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--request-s", type=float, default=0.01)
    parser.add_argument("--before", help="run the reader's step_sources of this commit")
    parser.add_argument(
        "--defer",
        action="store_true",
        help="compact with defer_removal (what a generation superseded goes at the next commit)",
    )
    args = parser.parse_args()
    if args.before:
        use_step_sources_of(args.before)
    slow_reader_requests(args.request_s)
    result = run(args.seconds, args.defer)
    errors = result.pop("errors")
    mode = "deferred removal" if args.defer else "removal at once"
    print(f"{args.before or 'HEAD'} request {args.request_s} s, {mode}: {result}")
    for line in errors:
        print(f"  failed {line}")


if __name__ == "__main__":
    main()
