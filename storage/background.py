"""One job at a time off the caller's thread: the learner's publication and state writer
(learner/publish.py `Writer`), its compaction (learner/compact.py) and the actors'
prefetch of policy versions (actors/prefetch.py) each run on a `Background`.

The rules, the same for all of them:
- at most one job in flight: `submit` first waits for the one before it;
- a job's error is kept and raised on the caller's thread by the next call (`submit`,
  `wait`, `poll` once the job has ended, `close`), once; `submit` then starts nothing;
- `close` is the clean stop: it waits for the job in flight, refuses any later `submit`,
  and raises that job's error if it had one; a second `close` does nothing.

The caller is one thread (the learner's update loop, the actor's poll): a `Background`
serialises its jobs, not its callers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class Background:
    """Runs the jobs handed to `submit` one at a time, each in a thread of its own (or at
    once on the caller's thread when not `asynchronous`), and hands back each job's result
    or error on the caller's thread. A `daemon` job does not hold the process at exit (a
    download or a compaction whose work is redone later); otherwise the process waits for
    it (a write a stopping learner must finish)."""

    def __init__(self, *, asynchronous: bool = True, daemon: bool = False) -> None:
        self.asynchronous, self.daemon = asynchronous, daemon
        self._thread: threading.Thread | None = None
        self._outcome: tuple[Any, BaseException | None] | None = None  # set by the job's thread
        self._closed = False

    @property
    def pending(self) -> bool:
        """A job was handed over and its outcome not yet taken: running, or ended with its
        result or error waiting for `wait` or `poll`."""
        return self._thread is not None or self._outcome is not None

    def submit(self, job: Callable[[], Any], *, name: str) -> None:
        """Run `job` (in a thread named `name`) once the job in flight is done; that job's
        error, if any, is raised here instead and `job` is not started. Not asynchronous:
        `job` runs now, and its error is raised by this call."""
        if self._closed:
            raise RuntimeError(
                f"{name}: submitted to a closed Background; accepted: before close()"
            )
        self.wait()
        if not self.asynchronous:
            self._work(job)
            if self._outcome[1] is not None:
                self._take()
            return
        self._thread = threading.Thread(
            target=self._work, args=(job,), name=name, daemon=self.daemon
        )
        self._thread.start()

    def _work(self, job: Callable[[], Any]) -> None:
        try:
            self._outcome = (job(), None)
        except BaseException as error:  # raised on the caller's thread by its next call
            self._outcome = (None, error)

    def wait(self) -> Any:
        """Until the job in flight, if any, is done: its result (None without one), or its
        error raised."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        return self._take()

    def poll(self) -> Any:
        """Without waiting: the result of a job that has ended (its error raised), or None
        while it runs or when none was handed over."""
        if self._thread is not None and self._thread.is_alive():
            return None
        return self.wait()

    def close(self) -> None:
        """Wait for the job in flight, then refuse new jobs; the job's error is raised
        here. Idempotent: a closed `Background` has nothing left to raise."""
        if self._closed:
            return
        self._closed = True
        self.wait()

    def _take(self) -> Any:
        if self._outcome is None:
            return None
        (result, error), self._outcome = self._outcome, None
        if error is not None:
            raise error
        return result
