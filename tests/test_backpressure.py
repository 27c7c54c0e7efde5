"""Backpressure: actors wait on the learner's backlog (read from the store) instead of
generating groups that the learner drops as stale; the learner is never starved by it."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import polars as pl
import pytest

from gagpo.actors.throttle import DEFAULT_BATCH_GROUPS, DEFAULT_MAX_STALENESS, Throttle, room
from gagpo.learner.feed import STALE, Feed, Ledger, pipeline_advantages
from gagpo.pipeline.config import GagpoConfig
from gagpo.schemas import columns as C
from gagpo.storage.store import Store
from tests.helpers.actors import actors_command
from tests.helpers.learner import ENV, ROOT, learner_beside_actors
from tests.helpers.steps import make_steps

ADV = pipeline_advantages(GagpoConfig())


def write(store: Store, shard_id: str, *, groups: int = 1, version: int = 0) -> None:
    table = make_steps(shard_id=shard_id, groups=groups, group_size=2, policy_version=version)
    store.write_shard(table, group_size=2)


# --- the arithmetic ------------------------------------------------------------------------


@pytest.mark.parametrize(("b", "s"), [(1, 0), (2, 0), (2, 1), (4, 3)])
def test_room_is_what_the_learner_can_still_use(b: int, s: int):
    kw = {"batch_groups": b, "max_staleness": s}
    # A new group at position N is trained at version V + ⌊N/B⌋: usable while that is ≤ p + S.
    assert room(0, learner_version=5, policy_version=5, **kw) == (s + 1) * b
    assert room((s + 1) * b - 1, learner_version=5, policy_version=5, **kw) == 1  # the boundary
    assert room((s + 1) * b, learner_version=5, policy_version=5, **kw) == 0
    assert room(10**6, learner_version=5, policy_version=5, **kw) == 0  # never negative
    # Each version the actor's policy lags behind costs one batch of room.
    assert room(0, learner_version=6, policy_version=5, **kw) == s * b
    assert room(0, learner_version=5 + s + 1, policy_version=5, **kw) == 0


@pytest.mark.parametrize(("b", "s"), [(2, 0), (2, 1), (3, 2)])
def test_a_fast_actor_never_makes_stale_groups_and_never_starves_the_learner(
    store_dir: Path, b: int, s: int
):
    """An actor infinitely faster than the learner fills the room at every moment of the
    learner's cycle (batch formed → ledger → publication), through the real store, ledger
    and feed: every batch is full and nothing is dropped as stale."""
    store = Store(str(store_dir))
    feed = Feed(
        store,
        Ledger(),
        ADV,
        batch_groups=b,
        max_staleness=s,
        poll_interval_s=0.01,
        idle_timeout_s=0.05,
    )
    throttle, shards = Throttle(store), iter(range(10**6))
    version = 0
    feed.announce(version)

    def actor() -> None:
        p = store.policies.latest() or 0
        while throttle.room(p) > 0:
            write(store, f"s{next(shards):05d}", version=p)

    for update in range(1, 7):
        actor()
        batch = feed.next_batch(version)
        assert batch is not None and len(batch.groups) == b, feed.stop_reason  # never starved
        assert not batch.stale
        actor()  # while the update runs
        feed.commit(batch, update, version)
        actor()  # ledger committed, version not yet published
        version += 1
        store.policies.set_latest(version)
    assert feed.stats.groups_stale == 0
    actor()
    backlog = throttle.backlog()
    assert backlog.groups == (s + 1) * b and backlog.learner_version == version


def test_backlog_is_read_from_the_store(store_dir: Path):
    store = Store(str(store_dir))
    throttle = Throttle(store)
    empty = throttle.backlog()
    assert (empty.groups, empty.learner_version, empty.learner_seen) == (0, 0, False)
    assert (empty.batch_groups, empty.max_staleness) == (
        DEFAULT_BATCH_GROUPS,
        DEFAULT_MAX_STALENESS,
    )
    write(store, "a", groups=3)
    write(store, "b", groups=2)
    assert throttle.backlog().groups == 5
    feed = Feed(store, Ledger(), ADV, batch_groups=2, max_staleness=1, follow=False)
    feed.announce(0)
    seen = throttle.backlog()
    assert (seen.batch_groups, seen.max_staleness, seen.learner_seen) == (2, 1, True)
    feed.commit(feed.next_batch(0), 1, 0)  # two of a's three groups
    after = throttle.backlog()
    assert after.groups == 3 and after.learner_version == 1
    # The groups the actor holds count too; the learner at version 1 leaves (1+1)·2 slots.
    assert throttle.room(1) == 1 and throttle.room(1, held=1) == 0 and throttle.room(0) == 0
    # A quarantined shard leaves the listing and the backlog.
    store.quarantine(store.shard_path("run1", "b"), "test")
    assert throttle.backlog().groups == 1


def test_feed_announces_nothing_without_a_staleness_bound(store_dir: Path, tmp_path: Path):
    store = Store(str(store_dir))
    Feed(store, Ledger(), ADV, batch_groups=2, max_staleness=None).announce(0)
    assert not Throttle(store).backlog().learner_seen
    assert not store.fs.exists(store.path("learner", "ledger.parquet"))


def test_a_following_actor_commits_what_it_holds_and_waits(store_dir: Path):
    """A learner with B = 1, max_staleness = 0 can use one group: the actor (4 groups per
    shard) makes it, commits it at once rather than holding it from the learner, and then
    waits, throttled, until SIGTERM, which it honours while waiting."""
    import threading

    from gagpo.actors.actor import run_actor
    from gagpo.actors.config import ActorConfig

    store = Store(str(store_dir))
    Feed(store, Ledger(), ADV, batch_groups=1, max_staleness=0).announce(0)
    config = ActorConfig(
        store=store.url,
        env="household",
        policy="tiny",
        group_size=2,
        max_turns=2,
        follow=True,
        groups_per_shard=4,
    )
    seen = []

    def learner_view() -> None:  # the shard shows up while the actor still runs
        deadline = time.monotonic() + 120
        while not store.list_shards() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.5)  # the actor now waits
        seen.append(Throttle(store).backlog().groups)
        os.kill(os.getpid(), signal.SIGTERM)

    watcher = threading.Thread(target=learner_view, daemon=True)
    watcher.start()
    summary = run_actor(config)
    watcher.join()
    assert seen == [1] and summary.groups == 1 and len(summary.shards) == 1
    assert summary.seconds_throttled >= 1.0


# --- actors and learner as processes -------------------------------------------------------


@pytest.mark.slow
def test_fast_actor_and_slow_learner_waste_almost_nothing(tmp_path: Path):
    """A fast actor (--follow) beside a slower learner (B = 2, max_staleness = 1): the
    actor waits instead of producing groups that go stale. Without backpressure most
    groups are never trained on (about 80 % here before it existed)."""
    store_dir, updates, b, s = tmp_path / "store", 6, 2, 1
    actor = subprocess.Popen(
        actors_command(store_dir, env="household", follow=True, group_size=4, max_turns=3),
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        learner = subprocess.run(
            learner_beside_actors(
                store_dir, updates=updates, batch_groups=b, max_staleness=s, micro_batch_tokens=4096
            ),
            cwd=ROOT,
            env=ENV,
            capture_output=True,
            text=True,
            timeout=400,
        )
        if learner.returncode == 0:
            time.sleep(2.0)  # the actor keeps running: it must stay throttled, not flood
    finally:
        actor.send_signal(signal.SIGTERM)
        out, err = actor.communicate(timeout=120)
    assert learner.returncode == 0, learner.stderr[-2000:] + err[-2000:]
    assert actor.returncode == 0, err[-3000:]
    store = Store(str(store_dir))
    generated = sum(
        len(store.read_table(r.path, [C.GROUP_ID])[C.GROUP_ID].unique())
        for r in store.list_shards()
    )
    ledger = pl.from_arrow(Ledger.load(store).table())
    stale = (ledger["status"] == STALE).sum()
    assert ledger.height - stale == updates * b
    assert stale <= 0.05 * generated, (stale, generated)
    # What is left unread is at most what the learner could still have used.
    assert generated - ledger.height <= (s + 1) * b + 1
    assert "throttled" in out
