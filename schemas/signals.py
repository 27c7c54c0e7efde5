"""Ctrl-C and the processes we start: a terminal's SIGINT reaches every process of the
group, children included, so children start with it held back (our CLIs) or ignored
(environment workers) and the parent stops them in order (workflows/launch.py,
actors/slots.py)."""

from __future__ import annotations

import contextlib
import signal
import threading

# Set by `gagpo run` for the processes it starts with SIGINT held (workflows/child.py): they take
# SIGINT back once their command runs, so a Ctrl-C during their imports is no traceback, and
# one that came meanwhile is delivered then (`take_sigint_back`).
SIGINT_FROM_PARENT = "GAGPO_SIGINT_FROM_PARENT"


@contextlib.contextmanager
def sigint_ignored(on: bool = True):
    """SIGINT ignored while child processes start: a terminal's Ctrl-C reaches every process
    of the group, and a child still importing its modules would print a traceback. A
    spawned or exec'd child keeps the ignored disposition; our own CLIs take SIGINT back
    once running (`run_cli`, SIGINT_FROM_PARENT), environment workers never do (their
    actor decides what stops). Dispositions belong to the main thread: elsewhere, nothing."""
    if not on or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def sigint_held(on: bool = True):
    """SIGINT blocked, not ignored, while our CLIs start: a child inherits the mask through
    exec, so a Ctrl-C during its imports stays pending instead of being lost, and it stops
    as soon as its command runs (`take_sigint_back`). Ignoring it instead would leave the
    child running until its parent's stop timeout. A SIGINT to this process meanwhile is
    delivered when the block ends. Masks belong to the main thread here: elsewhere, nothing."""
    if not on or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def take_sigint_back() -> None:
    """In a CLI started by `gagpo run` (SIGINT_FROM_PARENT): Ctrl-C raises KeyboardInterrupt
    again, and one held while it started is raised now."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
