"""Ctrl-C and the processes we start: a terminal's SIGINT reaches every process of the
group, children included, so children start with it ignored and the parent stops them in
order (workflows/launch.py, actors/slots.py)."""

from __future__ import annotations

import contextlib
import signal
import threading

# Set by `gagpo run` for the processes it starts with SIGINT ignored (workflows/launch.py): they
# take SIGINT back once their command runs, so a Ctrl-C during their imports is no traceback.
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
