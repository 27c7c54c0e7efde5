"""The round-6 compaction stress test, run many times in a row, on a loaded machine if
asked, against this tree or an older commit (issue 46; benchmarks/RESULTS.md, round 6).

    python benchmarks/faults/compaction_race.py --runs 20 --busy 2
    python benchmarks/faults/compaction_race.py --runs 5 --against 06a171a   # before the fix

Each run is one `pytest tests/test_reliability_round6_compaction.py` in its own process
(`-k` narrows it: `-k local`); `--busy N` keeps N processes spinning on the CPU for the
whole time (ended by their pid when it is done). `--against COMMIT` runs this tree's
test file on the code of COMMIT (a `git archive` in a temporary folder, the editable
install pointed at it for that process only), which is how the fix is shown to matter.
Prints one line a run (passed/failed, seconds, the sweeps' and storms' counts) and the
totals.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEST = "tests/test_reliability_round6_compaction.py"

# Runs pytest with the editable install's packages taken from argv[1] instead of ROOT.
RUNNER = """
import sys
finder = next(m for n, m in list(sys.modules.items()) if n.startswith("__editable___gagpo"))
old, new = sys.argv[1], sys.argv[2]
finder.MAPPING.update({k: v.replace(old, new, 1) for k, v in finder.MAPPING.items()})
sys.path.insert(0, new)
import pytest
sys.exit(pytest.main(sys.argv[3:]))
"""


def tree_of(commit: str, into: Path) -> Path:
    """`commit`'s files in `into`, with this tree's stress test beside them."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", commit], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    shutil.copy(ROOT / TEST, into / TEST)
    return into


def one_run(tree: Path, select: str | None) -> tuple[bool, float, list[str]]:
    args = [TEST, "-q", "-s", "-p", "no:cacheprovider", *(["-k", select] if select else [])]
    command = [sys.executable, "-c", RUNNER, str(ROOT), str(tree), *args]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=tree, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    # the counts the test prints (after the dots of the tests before), failures, totals
    wanted = re.compile(
        r"^[.FE]*((?:sweep|storm) .*)|^(FAILED .*|\d+ (?:passed|failed).*|  bad: .*)"
    )
    lines = [m.group(1) or m.group(2) for m in map(wanted.match, done.stdout.splitlines()) if m]
    return done.returncode == 0, seconds, lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--busy", type=int, default=0, help="CPU-spinning processes beside")
    parser.add_argument("--against", help="a commit whose code is run (default: this tree)")
    parser.add_argument("-k", dest="select", help="pytest -k of the stress test")
    options = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the busy ones end with it
    busy = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(options.busy)
    ]
    scratch = Path(tempfile.mkdtemp(prefix="gagpo-race-"))
    try:
        tree = tree_of(options.against, scratch) if options.against else ROOT
        failed = 0
        for run in range(1, options.runs + 1):
            ok, seconds, lines = one_run(tree, options.select)
            failed += not ok
            print(f"run {run}: {'passed' if ok else 'FAILED'} in {seconds:.0f} s", flush=True)
            for line in lines:
                print(f"    {line}", flush=True)
        where = f"commit {options.against}" if options.against else "this tree"
        print(
            f"{options.runs - failed} of {options.runs} runs passed ({where}, "
            f"{options.busy} busy processes beside)"
        )
        return 1 if failed else 0
    finally:
        for process in busy:
            process.kill()
            with contextlib.suppress(Exception):
                process.wait(timeout=10)
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
