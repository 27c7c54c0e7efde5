"""The learner's data feed: exactly-once ledger, staleness drops counted, quarantine."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from gagpo.learner.feed import STALE, TRAINED, Feed, Ledger, pipeline_advantages
from gagpo.pipeline.config import GagpoConfig
from gagpo.schemas import columns as C
from gagpo.storage.store import Store
from tests.helpers.steps import make_steps

ADV = pipeline_advantages(GagpoConfig())


def write(store: Store, shard_id: str, *, groups: int = 2, version: int = 0) -> None:
    table = make_steps(shard_id=shard_id, groups=groups, group_size=3, policy_version=version)
    store.write_shard(table, group_size=3)


def feed(store: Store, ledger: Ledger | None = None, **kw) -> Feed:
    kw = {"batch_groups": 3, "max_staleness": 4, "follow": False, **kw}
    return Feed(store, ledger if ledger is not None else Ledger.load(store), ADV, **kw)


def drain(f: Feed, version: int = 0, start_update: int = 1) -> list[list[str]]:
    out, update = [], start_update
    while (batch := f.next_batch(version)) is not None:
        out.append([g.group_id for g in batch.groups])
        f.commit(batch, update, version)
        update += 1
    return out


def test_batches_hold_whole_groups_with_advantages(store_dir: Path):
    store = Store(str(store_dir))
    for i in range(3):
        write(store, f"s{i}")
    batch = feed(store).next_batch(0)
    assert [g.group_id for g in batch.groups] == ["s0-g0", "s0-g1", "s1-g0"]
    steps = batch.steps
    assert set(steps[C.GROUP_ID]) == {"s0-g0", "s0-g1", "s1-g0"}
    assert steps.height == 3 * (2 + 3 + 4)  # 3 groups × rollouts of 2, 3, 4 steps
    assert steps[C.ADVANTAGE].null_count() == 0
    # Group-normalised advantages: zero mean in every group.
    means = steps.group_by(C.GROUP_ID).agg(pl.col(C.ADVANTAGE).mean())[C.ADVANTAGE]
    assert means.abs().max() < 1e-9


def test_ledger_gives_each_group_exactly_once_across_restarts(store_dir: Path):
    store = Store(str(store_dir))
    for i in range(3):
        write(store, f"s{i}")
    first = feed(store)
    batch = first.next_batch(0)
    first.commit(batch, 1, 0)
    # A batch formed but never committed (the learner died during the update) ...
    assert first.next_batch(0) is not None
    # ... is formed again by the restarted learner, which then finishes the data.
    rest = drain(feed(store), start_update=2)
    seen = [g.group_id for g in batch.groups] + [g for b in rest for g in b]
    assert sorted(seen) == sorted(f"s{i}-g{g}" for i in range(3) for g in range(2))
    assert len(seen) == len(set(seen))
    ledger = Ledger.load(store)
    assert all(ledger.shard_done(f"s{i}") for i in range(3))
    # A shard fully in the ledger is not even read again.
    again = feed(store)
    assert again.next_batch(0) is None and again.stats.shards_read == 0


def test_new_shards_are_picked_up_while_following(store_dir: Path):
    store = Store(str(store_dir))
    write(store, "s0")
    f = feed(store, follow=True, poll_interval_s=0.01, idle_timeout_s=0.2)
    assert f.next_batch(0) is None  # 2 groups < B = 3, nothing new arrives
    write(store, "s1")
    batch = f.next_batch(0)
    assert [g.group_id for g in batch.groups] == ["s0-g0", "s0-g1", "s1-g0"]


def test_stale_groups_are_dropped_counted_and_recorded(store_dir: Path):
    store = Store(str(store_dir))
    write(store, "a_old", version=1)
    write(store, "b_new", groups=3, version=5)
    f = feed(store, max_staleness=2)
    batch = f.next_batch(6)  # staleness 5 (dropped) and 1 (kept)
    assert [g.group_id for g in batch.groups] == ["b_new-g0", "b_new-g1", "b_new-g2"]
    assert [g.group_id for g in batch.stale] == ["a_old-g0", "a_old-g1"]
    assert f.stats.groups_stale == 2 and f.stats.steps_stale == 2 * 9
    f.commit(batch, 1, 6)
    statuses = dict(
        zip(
            *Ledger.load(store).table().select([C.GROUP_ID, "status"]).to_pydict().values(),
            strict=True,
        )
    )
    assert statuses == {"a_old-g0": STALE, "a_old-g1": STALE} | {
        f"b_new-g{i}": TRAINED for i in range(3)
    }


def test_bad_shards_are_quarantined_and_the_rest_go_on(store_dir: Path):
    store = Store(str(store_dir))
    write(store, "a")
    bad = store.shard_path("run1", "b")
    store.commit_bytes(bad, b"PAR1 this is not parquet")
    write(store, "c")
    f = feed(store)
    assert [g.group_id for g in f.next_batch(0).groups] == ["a-g0", "a-g1", "c-g0"]
    assert f.stats.shards_rejected == 1
    assert not store.fs.exists(bad)
    [record] = store.quarantined()
    assert record["original_path"] == bad and "Parquet" in record["reason"]


def test_replay_reads_a_source_read_only(store_dir: Path, tmp_path: Path):
    source = Store(str(tmp_path / "source"))
    write(source, "a")
    bad = source.shard_path("run1", "b")
    source.commit_bytes(bad, b"garbage")
    write(source, "c", version=0)
    out = Store(str(store_dir))
    f = feed(out, source=source, max_staleness=None)
    batches = drain(f, version=100)  # no staleness drop in replay
    assert batches == [["a-g0", "a-g1", "c-g0"], ["c-g1"]]  # the last batch is smaller
    assert source.fs.exists(bad) and f.stats.shards_rejected == 1
    assert Ledger.load(out).shard_done("c")


def test_ledger_truncation_and_double_consumption_guard(store_dir: Path):
    store = Store(str(store_dir))
    for i in range(3):
        write(store, f"s{i}")
    drain(feed(store))
    ledger = Ledger.load(store)
    assert len(ledger.truncated(1).rows) == 3 and len(ledger.truncated(0).rows) == 0
    with pytest.raises(Exception, match="consumed twice"):
        ledger.record(
            [next(iter(feed(store, ledger.truncated(0)).next_batch(0).groups))], TRAINED, 9, 0
        )


def test_a_stale_backlog_is_drained_without_sleeping(store_dir: Path, monkeypatch):
    """Shards whose groups go stale count as progress and are read on at once: a long poll
    interval and a short idle timeout still reach the fresh groups behind them."""
    import gagpo.learner.feed as feed_module

    store = Store(str(store_dir))
    for i in range(6):
        write(store, f"a{i}", version=0)  # 12 stale groups at learner version 10
    write(store, "b0", groups=3, version=9)
    slept = []
    monkeypatch.setattr(feed_module.time, "sleep", slept.append)
    f = feed(store, max_staleness=2, follow=True, poll_interval_s=30.0, idle_timeout_s=0.01)
    batch = f.next_batch(10)
    assert batch is not None and [g.group_id for g in batch.groups] == [
        f"b0-g{i}" for i in range(3)
    ]
    assert len(batch.stale) == 12 and f.stats.groups_stale == 12 and slept == []


def test_stale_drops_reach_the_ledger_before_the_feed_waits(store_dir: Path, monkeypatch):
    """Throttled actors read the backlog from the ledger: groups dropped while the learner
    waits for fresh ones are recorded at once (under the coming update), or actors and
    learner would wait on each other; the batch still reports them, recorded once."""
    import gagpo.learner.feed as feed_module

    store = Store(str(store_dir))
    write(store, "a0", version=0)
    f = feed(store, max_staleness=1, follow=True, poll_interval_s=0.01, idle_timeout_s=5.0)

    def actor_catches_up(seconds: float) -> None:  # called instead of sleeping
        ledger = Ledger.load(store).table()
        assert ledger["status"].to_pylist() == [STALE, STALE] and ledger["update"][0].as_py() == 4
        write(store, "b0", groups=3, version=3)

    monkeypatch.setattr(feed_module.time, "sleep", actor_catches_up)
    batch = f.next_batch(3, update=4)
    assert [g.group_id for g in batch.stale] == ["a0-g0", "a0-g1"] and len(batch.groups) == 3
    f.commit(batch, 4, 3)
    statuses = Ledger.load(store).table()["status"].to_pylist()
    assert statuses == [STALE, STALE, TRAINED, TRAINED, TRAINED]


def test_stop_reason_names_the_idle_timeout(store_dir: Path):
    store = Store(str(store_dir))
    write(store, "s0")
    f = feed(store, follow=True, poll_interval_s=0.01, idle_timeout_s=0.05)
    assert f.next_batch(0) is None
    assert f.stop_reason == (
        "no new committed groups for 0.05 s (idle-timeout); 0 shard(s) unread, 2 group(s) pending"
    )


def test_learner_that_runs_out_of_data_says_why_and_exits_non_zero(tmp_path: Path):
    """A backlog of 3 updates' worth, a poll interval longer than the idle timeout: the
    learner drains the backlog (no sleep between batches), then, with --updates 4, stops,
    says why in one line and exits 3."""
    from tests.helpers.learner import run_learner, tiny_model_dir, write_shards

    store = Store(str(tmp_path / "store"))
    write_shards(store, 3)  # 6 groups
    short = run_learner(
        "--store",
        store.url,
        "--policy",
        str(tiny_model_dir()),
        "--batch-groups",
        "2",
        "--micro-batch-tokens",
        "256",
        "--updates",
        "4",
        "--poll-interval",
        "1",
        "--idle-timeout",
        "0.3",
        "--quiet",
    )
    assert short.returncode == 3, short.stderr[-2000:]
    assert short.stderr == (
        "gagpo-learner: stopped after 3 of 4 updates: no new committed groups for 0.3 s "
        "(idle-timeout); 0 shard(s) unread, 0 group(s) pending\n"
    )
    assert "3 update(s) done" in short.stdout and store.policies.latest() == 3
