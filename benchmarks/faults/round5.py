"""Round 5 (issue 39) before/after: the round's probe tests against the code before it and now.

    python benchmarks/faults/round5.py --before 7d81324    # the code before round 5
    python benchmarks/faults/round5.py                     # HEAD

Runs tests/test_reliability_round5_{store,sql,endpoint}.py (HEAD's tests, HEAD's helpers). With
--before, a git worktree of that commit is made under /tmp and `import gagpo` resolves to it
(the package is installed editable with one folder per layer, so a folder gagpo/ whose layers
are links into the worktree goes first on PYTHONPATH; subprocesses inherit it). The few names
the tests import that did not exist yet are shimmed, so that every test runs and the old code's
behaviour is what fails it: the bounds and the token variable keep today's values (the old
endpoint had none to compare), _given_token raises (the old actor read no token), the old
Endpoint gets a token attribute it never checks (so the tests' requests reach it), and
OutsideStoreError is a class the old code never raises. Prints one line per test:
outcome and, for a failure, the last line of its error.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FILES = [f"tests/test_reliability_round5_{group}.py" for group in ("store", "sql", "endpoint")]
LAYERS = ("schemas", "envs", "actors", "pipeline", "learner", "workflows")

SHIMS = '''
import sys
import gagpo.envs.endpoint as endpoint
import gagpo.storage.store as store
from gagpo.schemas.errors import GagpoError

endpoint.MAX_CHAT_BYTES = 16 << 20
endpoint.MAX_CONTROL_BYTES = 64 << 10
endpoint.MAX_JSON_DEPTH = 64
endpoint.TOKEN_VARIABLE = "GAGPO_AGENT_TOKEN"


def _given_token():
    raise RuntimeError("no agent token before round 5")


endpoint._given_token = _given_token
# The old endpoint checked no Authorization header; a token the tests can send is all it lacks.
endpoint.Endpoint.token = "no-token-before-round-5"


class OutsideStoreError(GagpoError):
    """Never raised by the code before round 5."""


store.OutsideStoreError = OutsideStoreError
'''


def old_package(commit: str, scratch: Path) -> Path:
    """A folder whose gagpo/ resolves every layer to a worktree of commit, plus the shims."""
    tree = scratch / "tree"
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), commit],
        check=True,
        capture_output=True,
    )
    package = scratch / "path" / "gagpo"
    package.mkdir(parents=True)
    # A regular package (an __init__) so that the path finder wins over the editable finder.
    (package / "__init__.py").write_text("")
    for layer in LAYERS:
        (package / layer).symlink_to(tree / layer)
    (scratch / "path" / "round5_shims.py").write_text(SHIMS)
    return scratch / "path"


def outcomes(report: Path) -> list[tuple[str, str, str]]:
    """(test, outcome, last line of the error) for each test case in a junit report."""
    rows = []
    for case in ET.parse(report).iter("testcase"):
        name = f"{Path(case.get('file') or case.get('classname', '')).stem}::{case.get('name')}"
        problem = next(iter(case.findall("failure") + case.findall("error")), None)
        skipped = case.find("skipped")
        if problem is not None:
            text = (problem.get("message") or problem.text or "").strip().splitlines()
            rows.append((name, problem.tag, text[-1][:160] if text else ""))
        elif skipped is not None:
            rows.append((name, "skipped", (skipped.get("message") or "")[:160]))
        else:
            rows.append((name, "passed", ""))
    return rows


def run_tests(env: dict, plugin: list[str], selection: list[str], report: Path) -> None:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin]
    command += [f"--junitxml={report}", "-o", "junit_family=xunit1", *selection]
    subprocess.run(command, cwd=ROOT, env=env, capture_output=True)


def test_ids(env: dict, plugin: list[str], keyword: str) -> list[str]:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin]
    command += ["--collect-only", "-k", keyword, *FILES]
    listed = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True).stdout
    return [line for line in listed.splitlines() if "::" in line]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", metavar="COMMIT", help="run against this commit's code")
    parser.add_argument(
        "-k",
        dest="keyword",
        help="only the tests pytest -k selects, each in a process of its own: the SQL tests "
        "share one store per module, and a write that lands there fails every later test",
    )
    args = parser.parse_args()
    env = dict(os.environ)
    plugin: list[str] = []
    with tempfile.TemporaryDirectory(prefix="round5-") as scratch_dir:
        scratch = Path(scratch_dir)
        if args.before:
            path = old_package(args.before, scratch)
            env["PYTHONPATH"] = os.pathsep.join([str(path), str(ROOT)])
            plugin = ["-p", "round5_shims"]
        started = time.monotonic()
        selections = [[i] for i in test_ids(env, plugin, args.keyword)] if args.keyword else [FILES]
        rows = []
        for n, selection in enumerate(selections):
            report = scratch / f"report{n}.xml"
            run_tests(env, plugin, selection, report)
            rows += outcomes(report)
        wall = time.monotonic() - started
        if args.before:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(scratch / "tree")],
                check=False,
            )
    for name, outcome, message in rows:
        print(f"{outcome:8} {name}  {message}")
    counts = {o: sum(1 for _, x, _ in rows if x == o) for o in ("passed", "failure", "error")}
    print(f"{counts} of {len(rows)} in {wall:.0f} s")


if __name__ == "__main__":
    main()
