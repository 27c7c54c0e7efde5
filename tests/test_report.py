"""`gagpo report`: PNG plots and a Markdown summary from the SQL views."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
from click.testing import CliRunner

from gagpo.pipeline.inspect_cli import inspect
from gagpo.pipeline.report import write_report
from gagpo.schemas.errors import GagpoError
from gagpo.schemas.store import Store
from tests.steps_factory import make_steps
from tests.test_sql import build_known_store, write_histograms

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 2_000, path


@pytest.fixture
def known_store(tmp_path) -> Store:
    return build_known_store(Store(str(tmp_path / "store")))


def test_report_writes_figures_and_summary(known_store, tmp_path):
    out = tmp_path / "report"
    result = CliRunner().invoke(
        inspect, ["report", "--store", known_store.root, "--out", str(out)], catch_exceptions=False
    )
    assert result.exit_code == 0
    names = {"learning_curves.png", "advantages.png", "singleton_states.png", "credit_heatmap.png"}
    assert {p.name for p in out.glob("*.png")} == names
    for name in names:
        assert_png(out / name)
        assert f"wrote {out / name}" in result.output
    summary = (out / "summary.md").read_text()
    assert summary.startswith("# GAGPO store report")
    assert "no learner metrics yet" in summary
    for name in names:
        assert f"]({name})" in summary
    # Per-environment rows and both estimator tags are in the summary.
    assert "| grid | 1 | 2 | 7 | 0.5 | 0.5 | 0.4286 |" in summary
    assert "| gagpo | gagpo |" in summary and "| gigpo | gigpo |" in summary


def test_report_with_learner_metrics_and_chosen_trajectories(known_store, tmp_path):
    metrics = pa.table(
        {
            "update": [1, 2, 3],
            "version": [1, 2, 3],
            "loss": [0.3, 0.2, 0.1],
            "behavior_weight_mean": [1.0, 0.98, 1.01],
            "behavior_weight_max": [1.2, 1.5, 2.0],
            "staleness_mean": [0.0, 0.5, 1.0],
            "staleness_max": [0, 1, 2],
        }
    )
    known_store.write_parquet(metrics, known_store.path("learner", "metrics", "a.parquet"), {})
    write_histograms(known_store)
    report = write_report(known_store, tmp_path / "r", traj_ids=["b1", "b0", "a0"])
    assert (tmp_path / "r" / "learner.png") in report.figures
    for path in report.figures:
        assert_png(path)
    summary = report.summary.read_text()
    assert "no learner metrics yet" not in summary
    assert "| 3 | 3 | 0.1 |" in summary  # updates, last version, last loss


def test_report_on_steps_only_and_on_an_empty_store(tmp_path):
    store = Store(str(tmp_path / "store"))
    store.write_shard(make_steps(groups=2, group_size=3), group_size=3)
    report = write_report(store, tmp_path / "steps-only")
    assert sorted(p.name for p in report.figures) == ["learning_curves.png", "singleton_states.png"]
    assert "no advantages yet" in report.summary.read_text()

    (tmp_path / "empty").mkdir()
    report = write_report(str(tmp_path / "empty"), tmp_path / "empty-report")
    assert report.figures == []
    text = report.summary.read_text()
    assert "no committed shards yet" in text and "no learner metrics yet" in text


def test_unknown_trajectory_is_a_clear_error(known_store, tmp_path):
    with pytest.raises(GagpoError, match="--traj 'nope'"):
        write_report(known_store, tmp_path / "r", traj_ids=["nope"])
