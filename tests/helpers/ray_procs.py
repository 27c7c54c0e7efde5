"""`gagpo run` in a subprocess and the Ray processes of a run, found by pid and by Ray's
session folder, never by name (tests/test_ray_run.py, tests/test_ray_nodes.py)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

GAGPO = [sys.executable, "-m", "gagpo.workflows.cli"]
# What the Ray tests leave out of the recipe's closing work: unrelated to where processes run.
QUICK = ["--set", "run.eval_groups=0", "--set", "run.report=false", "--set", "run.credit=false"]


def ray_scratch(tag: str) -> Path:
    """A short scratch folder for Ray's sessions (its Unix socket paths must stay short)."""
    path = Path("/tmp") / f"gr{os.getpid()}{tag}"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir()
    return path


NATIVE_FRAME = re.compile(r"\(\+0x[0-9a-f]+\) \[0x[0-9a-f]+\]")


class Run:
    """`gagpo run` in a subprocess, its output collected line by line."""

    def __init__(self, args: list[str], env: dict[str, str]):
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [*GAGPO, "run", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            bufsize=1,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())

    def wait_for(self, pattern: str, timeout: float = 300) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if m := re.search(pattern, line):
                    return m
            assert self.proc.poll() is None, self.tail()
            time.sleep(0.2)
        raise AssertionError(f"no line matching {pattern!r}:\n{self.tail()}")

    def finish(self, timeout: float = 600) -> int:
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return code

    def text(self) -> str:
        return "\n".join(self.lines)

    def tail(self, chars: int = 3000) -> str:
        """The output's last characters for a failure message, a native backtrace's frames
        (pyarrow's, Ray's) folded into one line so that the message above them shows."""
        kept: list[str] = []
        for line in self.lines:
            if NATIVE_FRAME.search(line):
                if kept and kept[-1].startswith("  [native frames"):
                    n = int(kept[-1].split()[2]) + 1
                    kept[-1] = f"  [native frames {n}]"
                    continue
                line = "  [native frames 1]"
            kept.append(line)
        return "\n".join(kept)[-chars:]

    def child_pids(self) -> set[int]:
        return {int(m) for m in re.findall(r"\(ray\) started pid (\d+)", self.text())}
