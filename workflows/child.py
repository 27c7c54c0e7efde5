"""A process `gagpo run` starts: its output relayed line by line, its end on demand.

One primitive for the two places that start the plan's command lines: the local launcher
(workflows/launch.py), whose children share this terminal, and the Ray hosts
(workflows/ray_host.py), each holding one process on a node of the cluster.

- `Child(command, env, echo, label=…)` starts the command with stdout and stderr merged and
  relays every line to `echo` (prefixed `[label]` when a label is given) from a thread of
  its own, so that several children read together on one console;
- `poll()`, `wait(timeout)`, `returncode`, `pid` and `last_line` (the last non-blank line it
  printed: its own one-line error when it failed);
- `stop(timeout, sig)`: `sig` (SIGTERM unless told) while it runs, SIGKILL once `timeout`
  seconds have passed; `stop_all` does so to several at once, against one deadline.

Ctrl-C (schemas/signals.py): a terminal's SIGINT reaches every process of the group, so a
child of ours started from the terminal starts with SIGINT held and takes it back once its
command runs (SIGINT_FROM_PARENT), so a Ctrl-C during its imports stops it then; the parent
stops the children in order. A child on a Ray
host is in no terminal's group: it instead dies with its host (`dies_with_parent`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import threading
import time

from gagpo.schemas.signals import SIGINT_FROM_PARENT, sigint_held

PR_SET_PDEATHSIG = 1
RELAY_JOIN_S = 5.0  # how long the last lines of an ended child may take to reach `echo`


def _libc_prctl():
    with contextlib.suppress(OSError, AttributeError):
        return ctypes.CDLL(None, use_errno=True).prctl
    return None


_PRCTL = _libc_prctl()  # looked up before fork: the child only calls it


def die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the process that started it dies, however it
    dies; and SIGINT deliverable again. Ray starts its processes with SIGINT blocked, a mask
    its workers pass on through exec, so without this a learner on a Ray host would never see
    the SIGINT that stops it between updates (it would be killed after stop_timeout_s)."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def is_ours(command: list[str]) -> bool:
    """`python -m gagpo.…`: one of our CLIs, which takes SIGINT back once running. Not
    torchrun, which has its own rules."""
    return command[1:2] == ["-m"] and command[2].startswith("gagpo.")


class Child:
    """One started process, its output relayed to `echo` line by line."""

    def __init__(
        self,
        command: list[str],
        env: dict[str, str],
        echo,
        *,
        label: str | None = None,
        cwd: str | None = None,
        dies_with_parent: bool = False,
    ):
        """`env` is added to this process's environment. `dies_with_parent`: for a Ray host,
        whose child must end with it (`die_with_parent`); else the terminal's Ctrl-C rules."""
        from_terminal = not dies_with_parent and is_ours(command)
        extra = {"PYTHONUNBUFFERED": "1", **({SIGINT_FROM_PARENT: "1"} if from_terminal else {})}
        try:
            with sigint_held(from_terminal):  # ours take SIGINT back once running
                self.proc = subprocess.Popen(
                    command,
                    env={**os.environ, **env, **extra},
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    bufsize=1,
                    errors="replace",
                    cwd=cwd,
                    preexec_fn=die_with_parent if dies_with_parent else None,
                )
        except KeyboardInterrupt:  # a Ctrl-C to us alone, held while it started: pass it on
            self.proc.send_signal(signal.SIGINT)  # held there too: it stops once running
            raise
        self.last_line = ""
        self._prefix = f"[{label}] " if label else ""
        self._echo = echo
        self._relay = threading.Thread(
            target=self._relay_lines, name=f"relay-{label or self.proc.pid}", daemon=True
        )
        self._relay.start()

    def _relay_lines(self) -> None:
        for line in self.proc.stdout:
            if line.strip():
                self.last_line = line.strip()
            self._echo(self._prefix + line.rstrip())

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def poll(self) -> int | None:
        """Its exit code once it has ended, else None."""
        return self.proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        """Its exit code; subprocess.TimeoutExpired when it still runs after `timeout`."""
        return self.proc.wait(timeout=timeout)

    def relayed(self, timeout: float = RELAY_JOIN_S) -> None:
        """Wait for the relay of an ended child to pass on its last lines."""
        self._relay.join(timeout=timeout)

    def stop(self, timeout: float, sig: int = signal.SIGTERM) -> int:
        """`sig` while it runs, SIGKILL after `timeout` seconds; its exit code, its last
        lines relayed."""
        stop_all([self], timeout, sig)
        self.relayed()
        return self.proc.returncode


def stop_all(children: list[Child], timeout: float, sig: int) -> None:
    """`sig` to each child still running, then SIGKILL to any left after `timeout` seconds
    (one deadline for all); each is reaped. A second Ctrl-C while waiting kills at once."""
    for child in children:
        if child.poll() is None:
            child.proc.send_signal(sig)
    deadline = time.monotonic() + timeout
    for child in children:
        while True:
            try:
                child.wait(timeout=max(0.1, deadline - time.monotonic()))
                break
            except subprocess.TimeoutExpired:
                child.proc.kill()
            except KeyboardInterrupt:  # a second Ctrl-C: stop waiting politely
                child.proc.kill()
