"""A test hook for crash tests: hold a process at a named point so a test can SIGKILL it there.

`GAGPO_HOLD="<phase>:<n>:<path>"` (or, as before, `GAGPO_LEARNER_HOLD`) makes a process,
on reaching `phase` for the n-th time — in the learner: during update n — create the
file `path` (holding its pid) and sleep, so that the test kills it at exactly that point.

Phases: `commit-<folder>` inside every atomic commit of the store, after the temporary
file is written and before it is renamed (or PUT) into place, e.g. `commit-shards` (an
actor committing a shard) or `commit-learner` (the learner's ledger); the learner adds
`backward`, `checkpoint` and `publish` (learner/train.py, learner/publish.py). A
compaction (storage/compaction.py) passes `compact-written` (its files written, the
manifest not yet committed) and `compact-committed` (committed, the inbox not yet
cleared); those count occurrences even in the learner. Unset, this costs one environment
lookup.
"""

from __future__ import annotations

import os
import threading
import time

_ordinal: int | None = None  # the learner's current update; None: count occurrences
_seen: dict[str, int] = {}
_thread = threading.local()  # a thread working for one update while others run (see below)


def set_ordinal(n: int) -> None:
    global _ordinal
    _ordinal = n


def set_thread_ordinal(n: int | None) -> None:
    """This thread's points belong to update `n` whatever update runs meanwhile (the
    learner's state writer: the state of update n is written while n + 1 runs)."""
    _thread.ordinal = n if n is not None else _ordinal


def fault_point(phase: str) -> None:
    spec = os.environ.get("GAGPO_HOLD") or os.environ.get("GAGPO_LEARNER_HOLD")
    if not spec:
        return
    want_phase, want, path = spec.split(":", 2)
    if want_phase != phase:
        return
    _seen[phase] = _seen.get(phase, 0) + 1
    # A compaction runs beside the learner's updates (learner/compact.py): its phases count
    # occurrences, the n-th compaction reaching the phase, whatever update is under way.
    ordinal = None if phase.startswith("compact-") else getattr(_thread, "ordinal", _ordinal)
    if (ordinal if ordinal is not None else _seen[phase]) == int(want):
        with open(path, "w") as handle:
            handle.write(str(os.getpid()))
        time.sleep(3600)
