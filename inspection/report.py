"""`gagpo report`: PNG plots and a Markdown summary of one or several stores, all through
the SQL views.

Several stores (`--store gagpo=A --store grpo=B`) are runs compared on shared axes, one
colour per run in every figure. Curves are smoothed (an exponential moving average over
the points along training) with the raw points faint behind them.

This module opens the stores and writes the parts; the figures are drawn by
inspection/report_figures.py, inspection/report_credit.py (the heat map) and
inspection/report_analyses.py (the paper's three analyses, with their tables), on the
shared look of inspection/report_base.py; summary.md is written by
inspection/report_summary.py.

Figures (each written only when its data exists):
    learning_curves.png   success rate and mean return against environment steps, success
                          rate against policy version, per run; and, where the run was
                          evaluated on held-out tasks (view `heldout`), that success per
                          version (the same tasks for every version: no smoothing)
    episodes.png          invalid-action rate and episode length per policy version
    advantages.png        advantage distribution of every estimator on shared bins (log
                          counts: GRPO's spike at 0 does not hide the rest), and the mean
                          advantage by turn
    value_proxy.png       value proxy V̂(s) against the realised discounted return-to-go
    singleton_states.png  share of steps whose state occurs once in their group
    credit_heatmap.png    chosen rollouts turn by turn (state, action) × reward, value proxy,
                          TD residual and advantages, on one colour scale
    learner.png           loss, entropy, grad norm, lr, tokens/s, staleness, behaviour weight,
                          behaviour/learner mismatch per update, and the behaviour-weight
                          histogram on an axis fitted to the data
    early_learning.png    the paper's analyses (inspection/report_analyses.py): success
    interaction_efficiency.png  against environment steps consumed, environment steps per
    smoothness.png        successful episode over training, and the update-to-update
                          change |Δ| of loss, gradient norm and KL
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from gagpo.inspection.arguments import DEFAULT_GAMMA
from gagpo.inspection.report_analyses import (
    plot_early_learning,
    plot_interaction_efficiency,
    plot_smoothness,
)
from gagpo.inspection.report_base import Run, query_scalar
from gagpo.inspection.report_credit import plot_credit_heatmap
from gagpo.inspection.report_figures import (
    plot_advantages,
    plot_episodes,
    plot_learner,
    plot_learning_curves,
    plot_singletons,
    plot_value_proxy,
)
from gagpo.inspection.report_summary import summary
from gagpo.inspection.sql import Limits, close_store_db, open_store_db, time_limit
from gagpo.schemas.errors import GagpoError
from gagpo.storage.store import Store

PARTS = 11  # figures + summary, for a progress bar
_LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,39}$")


@dataclass
class Report:
    """What `write_report` wrote."""

    summary: Path
    figures: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def parse_store_spec(spec: str) -> tuple[str | None, str]:
    """`LABEL=URL` or `URL` (a label is letters, digits and `_.+-`, at most 40)."""
    label, sep, url = spec.partition("=")
    if sep and url and _LABEL.match(label) and "/" not in label and ":" not in label:
        return label, url
    return None, spec


def run_names(specs: list[tuple[str | None, str]]) -> list[str]:
    """One distinct name per (label, root): the label, else the root's last folder, else
    run<i>; a repeated folder name gets -<i>, a repeated label is one error line. `gagpo
    report` and `gagpo view` name runs this way."""
    names, seen = [], set()
    for i, (label, root) in enumerate(specs):
        name = label or PurePosixPath(root.rstrip("/")).name or f"run{i + 1}"
        if name in seen:
            if label:
                raise GagpoError(
                    f"--store label {label!r} is given twice; accepted: distinct labels"
                )
            name = f"{name}-{i + 1}"
        seen.add(name)
        names.append(name)
    return names


def _label_runs(specs: list[tuple[str | None, Store]]) -> list[tuple[str, Store]]:
    names = run_names([(label, store.root) for label, store in specs])
    return [(name, store) for name, (_, store) in zip(names, specs, strict=True)]


def write_report(
    stores: Store | str | Iterable[Store | str],
    out_dir: str | os.PathLike,
    *,
    traj_ids: list[str] | None = None,
    gamma: float = DEFAULT_GAMMA,
    progress: Callable[[str], None] | None = None,
    limits: Limits | None = None,
) -> Report:
    """Write the figures and `summary.md` for one store or several (`LABEL=URL` strings,
    URLs or Stores) into `out_dir`. `progress(name)` is called as each part is done."""
    from gagpo.schemas.extras import require

    require("report", "gagpo report")
    import matplotlib

    matplotlib.use("Agg")

    items = [stores] if isinstance(stores, Store | str) else list(stores)
    if not items:
        raise GagpoError("no store given; accepted: --store URL or --store LABEL=URL, repeatable")
    specs = []
    for item in items:
        label, url = (None, item) if isinstance(item, Store) else parse_store_spec(item)
        specs.append((label, url if isinstance(url, Store) else Store(url)))
    labelled = _label_runs(specs)
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise GagpoError(f"--out {str(out)!r} cannot be created ({exc.strerror})") from None
    runs = []
    try:
        for label, store in labelled:
            runs.append(Run(label, store, open_store_db(store, gamma=gamma, limits=limits)))
            if progress:
                progress(f"opened {label}")
        limits = limits or Limits()  # one time limit for the whole report
        with time_limit([run.con for run in runs], limits.timeout_s, limits.memory()):
            return _build(runs, out, traj_ids or [], progress or (lambda _: None))
    finally:
        for run in runs:
            close_store_db(run.con)


def _build(runs: list[Run], out: Path, traj_ids: list[str], progress) -> Report:
    report = Report(summary=out / "summary.md")
    for run in runs:
        run.has_steps = query_scalar(run.con, "SELECT count(*) FROM steps") > 0
        run.has_advantages = query_scalar(run.con, "SELECT count(*) FROM estimators") > 0
        run.has_learner = (
            query_scalar(run.con, "SELECT count(*) FROM learner_metrics")
            + query_scalar(run.con, "SELECT count(*) FROM learner_histograms")
        ) > 0
    if traj_ids and not any(r.has_advantages for r in runs):
        raise GagpoError("--traj needs stored advantages; run `gagpo advantages` first")
    plots = [
        ("learning_curves.png", "has_steps", plot_learning_curves),
        ("episodes.png", "has_steps", plot_episodes),
        ("advantages.png", "has_advantages", plot_advantages),
        ("value_proxy.png", "has_advantages", plot_value_proxy),
        ("singleton_states.png", "has_steps", plot_singletons),
        (
            "credit_heatmap.png",
            "has_advantages",
            lambda rs, p: plot_credit_heatmap(rs, p, traj_ids),
        ),
        ("learner.png", "has_learner", plot_learner),
        ("early_learning.png", "has_steps", plot_early_learning),
        ("interaction_efficiency.png", "has_steps", plot_interaction_efficiency),
        ("smoothness.png", "has_learner", plot_smoothness),
    ]
    for name, needs, plot in plots:
        have = [r for r in runs if getattr(r, needs)]
        if have and plot(have, out / name):
            report.figures.append(out / name)
        progress(name)
    for needs, note in [
        ("has_steps", "no committed shards yet"),
        ("has_advantages", "no advantages yet (run `gagpo advantages`)"),
        ("has_learner", "no learner metrics yet"),
    ]:
        missing = [r.label for r in runs if not getattr(r, needs)]
        if missing:
            report.notes.append(note if len(runs) == 1 else f"{note}: {', '.join(missing)}")
    report.summary.write_text(summary(runs, report.figures, report.notes), encoding="utf-8")
    progress("summary.md")
    return report
