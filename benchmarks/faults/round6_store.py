"""Round 6 (issue 46), the store: tests/test_reliability_round6_store.py against the code before
the round's confinement and now.

    python benchmarks/faults/round6_store.py --before a8cb150   # the code before it
    python benchmarks/faults/round6_store.py                    # HEAD

HEAD's tests run against a git worktree of the commit (as benchmarks/faults/round5.py does:
a folder gagpo/ whose layers link into the worktree goes first on PYTHONPATH; pytest runs
outside the checkout with --import-mode=append, so the checkout's own gagpo/ does not
shadow it). The names the
tests import that did not exist yet are shimmed, so that every test runs and the old code's
behaviour is what fails it: the bounds (layout.MAX_VERSION, delta.MAX_CHAIN and
RECORD_MAX_BYTES) take today's values, and storage/policy_cache.py, which the old code did
not have, is today's module (so its unit test of the sweep passes there; the old actors
never called a sweep). Prints one line per test: outcome and, for a failure, the last line
of its error. Slow tests run too (-m "").
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = "tests/test_reliability_round6_store.py"
LAYERS = ("schemas", "storage", "envs", "actors", "pipeline", "inspection", "learner", "workflows")

SHIMS = """
import gagpo.schemas.layout as layout
import gagpo.storage.delta as delta

layout.MAX_VERSION = getattr(layout, "MAX_VERSION", 10**7)
delta.MAX_CHAIN = getattr(delta, "MAX_CHAIN", 100)
delta.RECORD_MAX_BYTES = getattr(delta, "RECORD_MAX_BYTES", 1 << 20)
"""


def old_package(commit: str, scratch: Path) -> Path:
    tree = scratch / "tree"
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), commit],
        check=True,
        capture_output=True,
    )
    if not (tree / "storage" / "policy_cache.py").exists():
        shutil.copy(ROOT / "storage" / "policy_cache.py", tree / "storage" / "policy_cache.py")
    package = scratch / "path" / "gagpo"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    for layer in LAYERS:
        (package / layer).symlink_to(tree / layer)
    (scratch / "path" / "round6_shims.py").write_text(SHIMS)
    return scratch / "path"


def outcomes(report: Path) -> list[tuple[str, str, str]]:
    rows = []
    for case in ET.parse(report).iter("testcase"):
        problem = next(iter(case.findall("failure") + case.findall("error")), None)
        if problem is not None:
            text = (problem.get("message") or problem.text or "").strip().splitlines()
            rows.append((case.get("name"), problem.tag, text[-1][:200] if text else ""))
        else:
            rows.append((case.get("name"), "passed", ""))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", metavar="COMMIT", help="run against this commit's code")
    args = parser.parse_args()
    env, plugin = dict(os.environ), []
    with tempfile.TemporaryDirectory(prefix="round6-") as scratch_dir:
        scratch = Path(scratch_dir)
        if args.before:
            env["PYTHONPATH"] = os.pathsep.join([str(old_package(args.before, scratch)), str(ROOT)])
            plugin = ["-p", "round6_shims"]
        report = scratch / "report.xml"
        # Run from the scratch folder, the checkout appended to sys.path (not prepended: its
        # own gagpo/ would shadow the old package), so that `gagpo` is the commit's code.
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin]
        command += [
            "--import-mode=append",
            "--rootdir",
            str(ROOT),
            "-c",
            str(ROOT / "pyproject.toml"),
        ]
        command += ["-m", "", f"--junitxml={report}", str(ROOT / TESTS)]
        subprocess.run(command, cwd=scratch, env=env, capture_output=True)
        rows = outcomes(report)
        if args.before:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(scratch / "tree")],
                check=False,
            )
    for name, outcome, message in rows:
        print(f"{outcome:8} {name}  {message}")
    counts = {o: sum(1 for _, x, _ in rows if x == o) for o in ("passed", "failure", "error")}
    print(f"{counts} of {len(rows)}")


if __name__ == "__main__":
    main()
