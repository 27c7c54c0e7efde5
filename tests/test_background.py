"""storage/background.py: one job in flight, its error raised on the caller's thread by the
next call, and a clean stop; and its three users (publication, compaction, prefetch) built
on it."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from gagpo.storage.background import Background


class Held:
    """A job that runs until released, recording when it ran and on which thread."""

    def __init__(self, log: list, name: str, result=None, error: BaseException | None = None):
        self.log, self.name, self.result, self.error = log, name, result, error
        self.started, self.release = threading.Event(), threading.Event()

    def __call__(self):
        self.started.set()
        self.log.append(f"{self.name} start {threading.current_thread().name}")
        assert self.release.wait(timeout=30)
        self.log.append(f"{self.name} end")
        if self.error is not None:
            raise self.error
        return self.result


def _in_thread(call) -> threading.Thread:
    thread = threading.Thread(target=call)
    thread.start()
    return thread


def test_one_job_at_a_time_each_in_its_named_thread():
    log: list[str] = []
    jobs = Background()
    first, second = Held(log, "a", 1), Held(log, "b", 2)
    jobs.submit(first, name="job-a")
    assert first.started.wait(timeout=30) and jobs.pending
    handing = _in_thread(lambda: jobs.submit(second, name="job-b"))
    handing.join(timeout=0.3)
    assert handing.is_alive() and not second.started.is_set()  # b waits for a
    first.release.set()
    handing.join(timeout=30)
    second.release.set()
    assert jobs.wait() == 2 and not jobs.pending
    assert log == ["a start job-a", "a end", "b start job-b", "b end"]
    assert jobs.wait() is None  # nothing in flight: nothing to wait for


def test_poll_hands_over_a_result_once_without_waiting():
    jobs = Background()
    job = Held([], "a", result={"rows": 3})
    assert jobs.poll() is None  # none handed over
    jobs.submit(job, name="job-a")
    assert job.started.wait(timeout=30)
    assert jobs.poll() is None and jobs.pending  # running
    job.release.set()
    deadline = time.monotonic() + 30
    while (result := jobs.poll()) is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert result == {"rows": 3} and not jobs.pending
    assert jobs.poll() is None and jobs.wait() is None  # taken once


@pytest.mark.parametrize("call", ["wait", "poll", "submit", "close"])
def test_a_jobs_error_is_raised_once_by_the_next_call(call):
    log: list[str] = []
    jobs = Background()
    failing = Held(log, "a", error=OSError("disk full"))
    failing.release.set()
    jobs.submit(failing, name="job-a")
    deadline = time.monotonic() + 30
    while "a end" not in log:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.05)  # the job's thread keeps its error
    after = Held(log, "b", 2)
    after.release.set()
    with pytest.raises(OSError, match="disk full"):
        if call == "submit":
            jobs.submit(after, name="job-b")
        else:
            getattr(jobs, call)()
    assert not after.started.is_set()  # a submit that raised started nothing
    assert not jobs.pending and jobs.wait() is None and jobs.poll() is None  # raised once


def test_without_a_thread_the_job_runs_at_once_and_raises_in_the_same_call():
    jobs = Background(asynchronous=False)
    ran: list[str] = []
    jobs.submit(lambda: ran.append(threading.current_thread().name) or 7, name="job-a")
    assert ran == [threading.current_thread().name]  # the caller's own thread
    assert jobs.wait() == 7

    def fails():
        raise ValueError("torn")

    with pytest.raises(ValueError, match="torn"):
        jobs.submit(fails, name="job-b")
    assert jobs.wait() is None


def test_close_waits_for_the_job_in_flight_then_raises_its_error_once():
    log: list[str] = []
    jobs = Background()
    failing = Held(log, "a", error=RuntimeError("killed mid-write"))
    jobs.submit(failing, name="job-a")
    assert failing.started.wait(timeout=30)
    closed: list[BaseException] = []

    def close() -> None:
        try:
            jobs.close()
        except RuntimeError as error:
            closed.append(error)

    closing = _in_thread(close)
    closing.join(timeout=0.3)
    assert closing.is_alive()  # close waits for the job in flight
    failing.release.set()
    closing.join(timeout=30)
    assert log[-1] == "a end" and [str(e) for e in closed] == ["killed mid-write"]
    jobs.close()  # idempotent: nothing left to raise
    with pytest.raises(RuntimeError, match="job-b: submitted to a closed Background"):
        jobs.submit(Held(log, "b"), name="job-b")
    assert log == ["a start job-a", "a end"]  # nothing ran after close


def test_close_without_a_job_and_twice_is_quiet():
    jobs = Background()
    jobs.close()
    jobs.close()
    with pytest.raises(RuntimeError, match="closed"):
        jobs.submit(lambda: None, name="late")


def test_daemon_says_whether_a_job_may_hold_the_process_at_exit():
    for daemon in (False, True):
        jobs, seen = Background(daemon=daemon), []
        jobs.submit(lambda seen=seen: seen.append(threading.current_thread().daemon), name="j")
        jobs.wait()
        assert seen == [daemon]


# --- the users ----------------------------------------------------------------------------


def test_a_failed_compaction_is_raised_by_the_learners_next_collect(monkeypatch, tmp_path):
    """learner/compact.py: the compaction runs in a daemon thread; the update loop never
    waits for it (`collect()` is None while it runs) and takes its error at a collect."""
    from gagpo.learner import compact as K
    from gagpo.learner.config import CompactionSettings

    gate, threads = threading.Event(), []

    def compact(store, refs, rows, **options):
        threads.append(threading.current_thread())
        assert gate.wait(timeout=30)
        raise OSError("segment upload failed")

    monkeypatch.setattr(K, "compact", compact)
    monkeypatch.setattr(K, "consumed_shards", lambda refs, ledger, update: (["shard"], None))
    store = SimpleNamespace(list_shards=lambda: [])
    compactor = K.Compactor(store, CompactionSettings(every_updates=1))
    assert compactor.maybe_start(lambda: None, update=1) is False  # not due yet: counts from 1
    assert compactor.maybe_start(lambda: None, update=2) is True
    assert compactor.collect() is None  # running: the loop goes on
    assert compactor.maybe_start(lambda: None, update=3) is False  # one at a time
    assert threads[0].daemon and threads[0].name == "gagpo-compaction"
    gate.set()
    with pytest.raises(OSError, match="segment upload failed"):
        compactor.collect(wait=True)
    assert compactor.collect(wait=True) is None and compactor.compactions == 0
