"""What every figure of `gagpo report` shares: the run (a store, its label and its SQL
connection), queries as rows, and the look of a figure: one colour per run, raw points
faint behind a moving average, the same legend and the same empty panel. The figures are
drawn by inspection/report_figures.py, inspection/report_credit.py and
inspection/report_analyses.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from gagpo.storage.store import Store


@dataclass
class Run:
    """One store in the report, its label, and its SQL connection."""

    label: str
    store: Store
    con: object
    has_steps: bool = False
    has_advantages: bool = False
    has_learner: bool = False


def query_rows(con, query: str, params: list | None = None) -> list[dict]:
    """The rows of `query` as dicts keyed by column name."""
    relation = con.execute(query, params or [])
    names = [d[0] for d in relation.description]
    return [dict(zip(names, row, strict=True)) for row in relation.fetchall()]


def query_scalar(con, query: str, params: list | None = None):
    """The first column of the first row of `query`."""
    return con.execute(query, params or []).fetchone()[0]


def figure(rows: int, cols: int, width: float = 4.6, height: float = 3.2):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False)
    return fig, axes


def save(fig, path: Path) -> bool:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def colour(i: int):
    import matplotlib

    return matplotlib.colormaps["tab10"](i % 10)


def integer_ticks(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=5))  # long step counts stay legible


def finite(value) -> bool:
    return value is not None and math.isfinite(value)


def ema(values: list[float | None], span: float | None = None) -> list[float | None]:
    """Exponential moving average along training (span ≈ a tenth of the points, ≥ 2);
    missing values are skipped, not counted as 0."""
    import polars as pl

    n = sum(finite(v) for v in values)
    span = span or max(2.0, n / 10)
    series = pl.Series([v if finite(v) else None for v in values], dtype=pl.Float64)
    return series.ewm_mean(span=span, ignore_nulls=True, adjust=True).to_list()


def curve(ax, xs, ys, color, label: str | None) -> bool:
    """Raw points faint, the smoothed curve on top; False when there is nothing to draw."""
    points = [(x, y) for x, y in zip(xs, ys, strict=True) if x is not None and finite(y)]
    if not points:
        return False
    px, py = zip(*points, strict=True)
    ax.plot(px, py, "o", color=color, alpha=0.25, markersize=3, linewidth=0)
    ax.plot(px, ema(list(py)), "-", color=color, linewidth=1.8, label=label)
    return True


def legend(ax, runs: list[Run]) -> None:
    if len(runs) > 1 and ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, frameon=False)


def empty(ax, text: str = "not recorded") -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="grey")


def fmt(value) -> str:
    """A table cell: 4 significant digits, – for NULL, pipes escaped."""
    if value is None:
        return "–"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4g}"
    return str(value).replace("|", "\\|")


def markdown_table(rows: list[dict], columns: list[str]) -> list[str]:
    """A Markdown table of `rows` (dicts) in `columns` order."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in columns) + " |" for r in rows]
    return lines
