"""`gagpo report`: PNG plots and a Markdown summary from the SQL views."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
from click.testing import CliRunner

from gagpo.inspection.cli import inspect
from gagpo.inspection.report import write_report
from gagpo.schemas.errors import GagpoError
from gagpo.storage.store import Store
from tests.helpers.sql import build_known_store, write_histograms
from tests.helpers.steps import make_steps

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
    names = {
        "learning_curves.png",
        "episodes.png",
        "advantages.png",
        "value_proxy.png",
        "singleton_states.png",
        "credit_heatmap.png",
        "early_learning.png",
        "interaction_efficiency.png",
    }
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
    assert (tmp_path / "r" / "smoothness.png") in report.figures
    for path in report.figures:
        assert_png(path)
    summary = report.summary.read_text()
    assert "no learner metrics yet" not in summary
    assert "| 3 | 3 | 0.1 |" in summary  # updates, last version, last loss


def test_report_on_steps_only_and_on_an_empty_store(tmp_path):
    store = Store(str(tmp_path / "store"))
    store.write_shard(make_steps(groups=2, group_size=3), group_size=3)
    report = write_report(store, tmp_path / "steps-only")
    assert sorted(p.name for p in report.figures) == [
        "early_learning.png",
        "episodes.png",
        "interaction_efficiency.png",
        "learning_curves.png",
        "singleton_states.png",
    ]
    assert "no advantages yet" in report.summary.read_text()

    (tmp_path / "empty").mkdir()
    report = write_report(str(tmp_path / "empty"), tmp_path / "empty-report")
    assert report.figures == []
    text = report.summary.read_text()
    assert "no committed shards yet" in text and "no learner metrics yet" in text


def test_unknown_trajectory_is_a_clear_error(known_store, tmp_path):
    with pytest.raises(GagpoError, match="--traj 'nope'"):
        write_report(known_store, tmp_path / "r", traj_ids=["nope"])


def test_two_stores_are_compared_on_shared_axes(tmp_path):
    """One store's shards re-advantaged with GAGPO and with GRPO: two runs, labelled."""
    from gagpo.pipeline.config import parse_estimator_config
    from gagpo.pipeline.recompute import recompute_store

    stores = {}
    for name in ("gagpo", "grpo"):
        store = Store(str(tmp_path / f"store-{name}"))
        for k in range(3):
            store.write_shard(
                make_steps(shard_id=f"s{k}", groups=2, group_size=3, policy_version=k), group_size=3
            )
        recompute_store(store.url, None, parse_estimator_config({"estimator": name}))
        stores[name] = store
    done: list[str] = []
    report = write_report(
        [f"{n}={s.root}" for n, s in stores.items()], tmp_path / "r", progress=done.append
    )
    names = {p.name for p in report.figures}
    assert {
        "learning_curves.png",
        "advantages.png",
        "value_proxy.png",
        "credit_heatmap.png",
    } <= names
    for path in report.figures:
        assert_png(path)
    summary = report.summary.read_text()
    assert (
        "## Runs compared" in summary and "# Run `gagpo`" in summary and "# Run `grpo`" in summary
    )
    assert "| gagpo | `" in summary and "| grpo | `" in summary
    assert "no learner metrics yet: gagpo, grpo" in summary
    assert done[:2] == ["opened gagpo", "opened grpo"] and done[-1] == "summary.md"


def test_store_labels(tmp_path):
    from gagpo.inspection.report import parse_store_spec

    assert parse_store_spec("gagpo=runs/a") == ("gagpo", "runs/a")
    assert parse_store_spec("s3://bucket/x=1") == (None, "s3://bucket/x=1")
    assert parse_store_spec("runs/a") == (None, "runs/a")
    with pytest.raises(GagpoError, match="label 'a' is given twice"):
        write_report(["a=x", "a=y"], tmp_path / "never")


def test_report_shows_the_heldout_evaluation(known_store, tmp_path):
    from gagpo.schemas import columns as C
    from gagpo.schemas.layout import EVAL, HELDOUT

    before = write_report(known_store.root, tmp_path / "before")
    table = pa.Table.from_pylist(
        [
            {
                "policy_version": v,
                "rollouts": 16,
                "success_rate": s,
                "valid_rate": 1.0,
                "mean_return": s,
                "task_seed": 7,
            }
            for v, s in ((0, 0.25), (5, 0.75))
        ],
        schema=C.HELDOUT_SCHEMA,
    )
    known_store.write_parquet(table, known_store.path(EVAL, HELDOUT), {b"gagpo.eval": b"test"})
    after = write_report(known_store.root, tmp_path / "after")
    summary = after.summary.read_text()
    assert "## Held-out evaluation" in summary and "| 5 | 16 | 0.75 | 1 | 0.75 | 7 |" in summary
    from gagpo.inspection.intervals import change_line, wilson

    low, high = wilson(12, 16)  # each row with its 95 % interval; the change v0 → last
    assert f"| 5 | 16 | 0.75 | 1 | 0.75 | 7 | {low:.4g} | {high:.4g} |" in summary
    assert f"25.0% → 75.0%, {change_line(0.25, 16, 0.75, 16)}" in summary
    assert "Held-out" not in before.summary.read_text()
    # The learning curves gain a fourth panel: a wider figure than without the evaluation.
    from PIL import Image

    width = lambda r: Image.open(r.summary.parent / "learning_curves.png").size[0]  # noqa: E731
    assert width(after) > width(before) * 1.2
