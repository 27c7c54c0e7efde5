"""The Python steps of benchmarks/gpu_learn.sh:

    link DIR                     make the checkout importable as gagpo from DIR on a machine
                                 where it is not installed (stdlib only)
    evaluate --store S ...       the held-out evaluation of `gagpo run` on a run's kept
                                 versions (workflows/evaluate.py), after training
    tables --run LABEL=STORE ... tables.md: held-out success v0 → last per estimator, seconds
                                 per update and per run, and the paper's three analyses of
                                 `gagpo report` with the runs side by side

The held-out evaluation is run here rather than inside `gagpo run` so that a run stopped
at the script's deadline is still evaluated: v0, every kept `--every`-th version and the
last one, on the same tasks (`gagpo run` evaluates the same versions the same way).
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def link(target: Path) -> None:
    """The layer folders under target/gagpo/ (links into this checkout) and gagpo's
    dist-info with its entry points from pyproject.toml, so that the built-in environments
    are registered as they are for an installed gagpo (envs/registry.py)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    dirs = project["tool"]["setuptools"]["package-dir"]
    package = target / "gagpo"
    package.mkdir(parents=True, exist_ok=True)
    for name, folder in dirs.items():
        if name == "gagpo":
            continue
        link_path = package / name.removeprefix("gagpo.")
        if not link_path.exists():
            link_path.symlink_to(ROOT / folder, target_is_directory=True)
    init = package / "__init__.py"
    if not init.exists():
        init.symlink_to(ROOT / dirs["gagpo"] / "__init__.py")
    meta = project["project"]
    info = target / f"gagpo-{meta['version']}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: gagpo\nVersion: {meta['version']}\n"
    )
    lines = []
    for group, points in project["project"]["entry-points"].items():
        lines += [f"[{group}]", *(f"{k} = {v}" for k, v in points.items()), ""]
    lines += ["[console_scripts]", *(f"{k} = {v}" for k, v in meta["scripts"].items()), ""]
    (info / "entry_points.txt").write_text("\n".join(lines))


def evaluate(recipe: str, store: str, sets: list[str], groups: int, every: int) -> None:
    from gagpo.storage.store import Store
    from gagpo.workflows.evaluate import change, evaluate_run, table
    from gagpo.workflows.recipe import load_recipe

    config = load_recipe(recipe, store, sets=sets)
    rows = evaluate_run(
        Store(store), config.actors, groups=groups, every=every, seed=config.run.eval_seed
    )
    if not rows:
        raise SystemExit(f"gpu_learn: {store} holds no published version to evaluate")
    print(table(rows, groups, config.actors.group_size))
    print(change(rows))


def _timing(con, wall_s: float | None) -> dict:
    from gagpo.inspection.report_base import query_rows

    row = query_rows(
        con,
        'SELECT count(*) AS updates, max("update") AS last_update, '
        "median(update_s) AS median_update_s, sum(update_s) AS learner_s FROM learner_metrics",
    )[0]
    row["run_s"] = wall_s
    row["s_per_update"] = wall_s / row["updates"] if wall_s and row["updates"] else None
    return row


def _heldout(label: str, con) -> dict:
    from gagpo.inspection.intervals import change_line, wilson
    from gagpo.inspection.report_base import query_rows

    rows = query_rows(
        con, "SELECT policy_version, rollouts, success_rate FROM heldout ORDER BY policy_version"
    )
    if not rows:
        return {"run": label, "first": None, "last": None, "change": "not evaluated"}
    first, last = rows[0], rows[-1]

    def cell(r):
        low, high = wilson(r["success_rate"] * r["rollouts"], r["rollouts"])
        return (
            f"v{r['policy_version']}: {r['success_rate']:.1%} [{low:.1%}, {high:.1%}] "
            f"of {r['rollouts']}"
        )

    return {
        "run": label,
        "first": cell(first),
        "last": cell(last),
        "change": change_line(
            first["success_rate"], first["rollouts"], last["success_rate"], last["rollouts"]
        ),
        "versions": ", ".join(f"v{r['policy_version']} {r['success_rate']:.1%}" for r in rows),
        "rates": {r["policy_version"]: r["success_rate"] for r in rows},
    }


def _over_seeds(heldout: list[dict]) -> list[dict]:
    """Per estimator (the label before "-s<seed>"): held-out success of v0 and of the last
    version every seed reached, mean and min–max over seeds, and the gain paired by seed."""
    by_estimator: dict[str, list[dict]] = {}
    for h in heldout:
        if h.get("rates"):
            by_estimator.setdefault(h["run"].rsplit("-s", 1)[0], []).append(h["rates"])
    rows = []
    for name, rates in by_estimator.items():
        common = sorted(set.intersection(*(set(r) for r in rates)))
        first, last = common[0], common[-1]

        def band(values: list[float], unit: str = "%") -> str:
            mean, low, high = (
                100 * x for x in (sum(values) / len(values), min(values), max(values))
            )
            return (
                f"{mean:+.1f}{unit} [{low:+.1f}, {high:+.1f}]"
                if unit != "%"
                else (f"{mean:.1f}% [{low:.1f}, {high:.1f}]")
            )

        rows.append(
            {
                "estimator": name,
                "seeds": len(rates),
                "first": f"v{first}: " + band([r[first] for r in rates]),
                "last": f"v{last}: " + band([r[last] for r in rates]),
                "gain (paired by seed)": band([r[last] - r[first] for r in rates], " pts"),
            }
        )
    return rows


def tables(runs: list[str], walls: list[str], out: Path, title: str) -> Path:
    """tables.md in `out` and the report (figures, summary.md) in out/report."""
    from gagpo.inspection.report import parse_store_spec, write_report
    from gagpo.inspection.report_base import markdown_table
    from gagpo.inspection.sql import close_store_db, open_store_db
    from gagpo.storage.store import Store

    wall = {k: float(v) for k, _, v in (w.partition("=") for w in walls)}
    report = write_report(runs, out / "report")
    heldout, timing = [], []
    for spec in runs:
        label, url = parse_store_spec(spec)
        con = open_store_db(Store(url))
        try:
            heldout.append(_heldout(label or url, con))
            timing.append({"run": label or url, **_timing(con, wall.get(label or url))})
        finally:
            close_store_db(con)
    summary = report.summary.read_text(encoding="utf-8")
    analyses = summary.split("## The paper's three analyses", 1)
    lines = [f"# {title}", "", "## Held-out success, first → last evaluated version", ""]
    lines += markdown_table(heldout, ["run", "first", "last", "change"])
    seeds = _over_seeds(heldout)
    if any(r["seeds"] > 1 for r in seeds):
        lines += ["", "Over seeds: mean [min, max]; the last version every seed reached.", ""]
        lines += markdown_table(seeds, list(seeds[0]))
    lines += ["", "Every evaluated version:", ""]
    lines += [f"- {h['run']}: {h.get('versions', 'none')}" for h in heldout]
    lines += ["", "## Seconds per update and per run", ""]
    lines += [
        "run_s: wall seconds of the training phase (actors and learner together, start to "
        "stop); s_per_update: run_s / updates; median_update_s: the learner's own update "
        "(learner_metrics.update_s).",
        "",
        *markdown_table(timing, list(timing[0])),
    ]
    if len(analyses) == 2:
        section = analyses[1].split("\n# Run ", 1)[0]
        lines += ["", "## The paper's three analyses" + section.rstrip()]
    figures = ", ".join(p.name for p in report.figures)
    lines += ["", f"Report: {report.summary} (figures: {figures})", ""]
    path = out / "tables.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("link")
    p.add_argument("dir", type=Path)
    e = sub.add_parser("evaluate")
    e.add_argument("--recipe", default="llm-demo")
    e.add_argument("--store", required=True)
    e.add_argument("--set", dest="sets", action="append", default=[])
    e.add_argument("--groups", type=int, required=True)
    e.add_argument("--every", type=int, required=True)
    t = sub.add_parser("tables")
    t.add_argument("--run", dest="runs", action="append", required=True, help="LABEL=STORE")
    t.add_argument("--wall", dest="walls", action="append", default=[], help="LABEL=SECONDS")
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--title", default="gpu_learn")
    args = parser.parse_args(argv)
    if args.command == "link":
        link(args.dir)
    elif args.command == "evaluate":
        evaluate(args.recipe, args.store, args.sets, args.groups, args.every)
    else:
        print(tables(args.runs, args.walls, args.out, args.title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
