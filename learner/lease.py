"""One learner per store (docs/design.md §7): a lease that a second learner, resumed or
not, cannot take while the first holds it.

    learner/lease/<generation:08d>.json   {"token", "host", "pid", "acquired_at",
                                           "renewed_at", "ttl_s", "released"}

The holder is the learner that wrote the newest generation. To take the lease a learner
creates the next generation with an exclusive create (`Store.create_exclusive`: link(2)
on a local disk or NFS, a PUT with `If-None-Match: *` on S3), so of two learners racing
for it exactly one wins. It may try only when the newest generation is free:

- released (its learner ended normally);
- held by a process of this host that no longer runs (a killed learner: free at once);
- or not renewed for `ttl_s` seconds *as this learner watches it* (its own monotonic
  clock, so clocks of different hosts need not agree): a learner killed on another host
  is replaced after at most `ttl_s`.

A lease seen renewed while the newcomer watches is held by a live learner: the newcomer
stops with one line. The holder renews its file from a background thread every
`ttl_s / 6` seconds, whatever the update loop is doing, so a long update never lets the
lease lapse; and before each publication (`check_lease`) it makes sure its generation is
still the newest and that it renewed within `ttl_s`. A learner that lost its lease
(frozen, or cut off from the store for longer than `ttl_s` while another took over)
stops before it publishes.

`ttl_s` is 60 s by default ($GAGPO_LEASE_TTL_S): six renewals per period tolerate a store
that answers slowly for most of a minute, and a `--resume` after a crash on another host
waits at most a minute (on the same host, not at all).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import threading
import time
import uuid

from gagpo.schemas import layout
from gagpo.schemas.errors import GagpoError, describe
from gagpo.storage.retry import env_seconds, retrying
from gagpo.storage.store import Store

LEASE_TTL_S = 60.0
LEASE_TTL_ENV = "GAGPO_LEASE_TTL_S"
log = logging.getLogger("gagpo.lease")
_held: dict[str, Lease] = {}  # store URL -> the lease this process holds on it


class LeaseLostError(GagpoError):
    """This learner no longer holds the store's lease: it must not publish."""


def lease_ttl() -> float:
    return env_seconds(LEASE_TTL_ENV, LEASE_TTL_S, allow_zero=False)


def newest(store: Store) -> tuple[int, dict | None]:
    """The newest lease generation and its record (0 and None before the first lease)."""
    generations = []
    for path in store.glob(layout.lease(store.root, "*")):
        if (found := layout.parse_lease(path)) is not None:
            generations.append(found)
    if not generations:
        return 0, None
    generation = max(generations)
    try:
        raw = store.read_bytes(layout.lease(store.root, generation))
        return generation, json.loads(raw)
    except (FileNotFoundError, ValueError):  # being written, or not ours: take it as held
        return generation, {"token": f"unreadable-{generation}", "renewed_at": None}


def _dead_here(record: dict) -> bool:
    """Whether the lease's learner ran on this host and no longer runs."""
    if record.get("host") != socket.gethostname() or not isinstance(record.get("pid"), int):
        return False
    if record["pid"] == os.getpid():
        return record.get("token") not in {lease.token for lease in _held.values()}
    try:
        os.kill(record["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


class Lease:
    """The lease of one store, held by this process; renewed by a background thread."""

    def __init__(self, store: Store, generation: int, ttl_s: float) -> None:
        self.store, self.generation, self.ttl_s = store, generation, ttl_s
        self.token = uuid.uuid4().hex
        self.path = layout.lease(store.root, generation)
        self.acquired_at = time.time()
        self._renewed = time.monotonic()  # last successful renewal, this process's clock
        self._lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def record(self, *, released: bool = False) -> bytes:
        return json.dumps(
            {
                "token": self.token,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "acquired_at": self.acquired_at,
                "renewed_at": time.time(),
                "ttl_s": self.ttl_s,
                "released": released,
            }
        ).encode()

    @property
    def interval_s(self) -> float:
        return self.ttl_s / 6

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._heartbeat, name="gagpo-lease", daemon=True)
        self._thread.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.renew()
            except LeaseLostError as exc:
                self._lost = str(exc)
                return
            except Exception as exc:  # an outage: renew at the next beat (the bound is ttl_s)
                log.warning("lease of %s: renewal failed (%s)", self.store.url, describe(exc))

    def _once(self, what: str, action):
        """One store call of the heartbeat, retried for one beat at most."""
        where = f"store {self.store.url}"
        return retrying(action, what, bound_s=self.interval_s, where=where)

    def renew(self) -> None:
        """Rewrite this lease's file with a fresh renewal time, if it is still the newest."""
        self._verify()
        data = self.record()
        self._once(f"renewing {self.path}", lambda: self.store._commit_once(self.path, data))
        self._renewed = time.monotonic()

    def _verify(self) -> None:
        generation, record = newest(self.store)
        if generation != self.generation or (record or {}).get("token") != self.token:
            holder = _describe_holder(record)
            raise LeaseLostError(
                f"store {self.store.url}: this learner lost its lease (generation "
                f"{self.generation}) to {holder}, which took it over after this one was not "
                f"renewed for {self.ttl_s:g} s; stopped before publishing. accepted: one "
                "learner per store"
            )

    def check(self) -> None:
        """Before each publication: still the holder, renewed within `ttl_s`."""
        if self._lost:
            raise LeaseLostError(self._lost)
        lapsed = time.monotonic() - self._renewed
        self._verify()  # asks the store, retried up to its bound
        if lapsed >= self.ttl_s:  # another learner may be taking it over right now
            raise LeaseLostError(
                f"store {self.store.url}: this learner could not renew its lease for "
                f"{lapsed:.0f} s (more than {self.ttl_s:g} s), so another learner may hold it; "
                "stopped before publishing. accepted: a store that answers within the lease "
                f"period (${LEASE_TTL_ENV})"
            )

    def release(self) -> None:
        """Mark the lease free (a normal end): the next learner takes it at once."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval_s + 5)
        _held.pop(self.store.url, None)
        if self._lost:
            return
        try:
            self._verify()
            data = self.record(released=True)
            release = lambda: self.store._commit_once(self.path, data)  # noqa: E731
            self.store.retrying(f"releasing {self.path}", release)
        except Exception as exc:  # the lease then expires after ttl_s
            log.warning("lease of %s: not released (%s)", self.store.url, describe(exc))


def _describe_holder(record: dict | None) -> str:
    """'the learner with pid P on host H', as far as the record says."""
    if not record or not record.get("host"):
        return "another learner"
    return f"the learner with pid {record.get('pid')} on host {record.get('host')}"


def acquire(store: Store, *, ttl_s: float | None = None, sleep=time.sleep) -> Lease:
    """Take the store's lease (see the module docstring), or raise GagpoError naming its
    holder. Waits at most `ttl_s` for a lease that may belong to a killed learner."""
    ttl = lease_ttl() if ttl_s is None else ttl_s
    mine = _held.get(store.url)
    if mine is not None:  # this process holds it already (a second run in one process)
        try:
            mine.check()
            return mine
        except LeaseLostError:  # taken over, or its folder removed: take it afresh
            mine.release()
    watched, since = None, time.monotonic()
    while True:
        generation, record = newest(store)
        key = None if record is None else (record.get("token"), record.get("renewed_at"))
        renewed = record is not None and watched is not None and key != watched
        if renewed and not record.get("released"):
            raise _held_error(store, record, ttl)
        if watched is None or key != watched:
            watched, since = key, time.monotonic()
        free = (
            record is None
            or record.get("released")
            or _dead_here(record)
            or time.monotonic() - since >= ttl
        )
        if free:
            lease = Lease(store, generation + 1, ttl)
            if store.create_exclusive(lease.path, lease.record()):
                _held[store.url] = lease
                lease._start()
                _prune(store, generation + 1)
                return lease
            continue  # another learner created that generation first: look again
        sleep(min(ttl / 6, max(ttl - (time.monotonic() - since), 0.05)))


def _held_error(store: Store, record: dict, ttl: float) -> GagpoError:
    return GagpoError(
        f"store {store.url} is leased by {_describe_holder(record)}, which renewed it while "
        f"this one watched; one learner per store. accepted: stop that "
        f"learner first (its lease is free at once when it ends, {ttl:g} s after it was killed), "
        "or use another store"
    )


def _prune(store: Store, generation: int) -> None:
    """Remove generations older than the previous one (best effort: housekeeping)."""
    for path in store.glob(layout.lease(store.root, "*")):
        old = layout.parse_lease(path)
        if old is not None and old < generation - 1:
            try:
                store.remove(path)
            except Exception:  # a later learner prunes it
                return


def check_lease(store: Store) -> None:
    """Before a publication: raise LeaseLostError if this process held the store's lease
    and lost it. Callers that never took one (tools, tests of publication) pass."""
    lease = _held.get(store.url)
    if lease is not None:
        lease.check()


def release_lease(store: Store) -> None:
    lease = _held.get(store.url)
    if lease is not None:
        lease.release()


@atexit.register
def _release_all() -> None:
    for lease in list(_held.values()):
        lease.release()
