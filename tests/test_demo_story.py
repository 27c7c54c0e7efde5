"""The demo's closing story (issue 24): the credit comparison on a run's own store (real
sokoban rollouts, recomputed under GRPO, GiGPO and GAGPO, measured against the solver), the
binomial intervals of the printed tables, and the closing lines of `gagpo run`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from gagpo.inspection.intervals import change_line, difference, wilson
from gagpo.schemas import columns as C
from gagpo.schemas.errors import GagpoError
from gagpo.storage.store import Store
from gagpo.workflows import credit
from tests.helpers.actors import small_sokoban
from tests.helpers.steps import make_steps


@pytest.fixture(scope="module")
def sokoban_store(tmp_path_factory) -> str:
    """Real rollouts of the untrained tiny policy: 4 sokoban tasks × 4 rollouts, 3 turns
    (fixed run id and seed: the same store every time)."""
    store = tmp_path_factory.mktemp("credit") / "store"
    small_sokoban(store, groups=4, run_id="story")
    return str(store)


@pytest.fixture(scope="module")
def comparison(sokoban_store) -> credit.Comparison:
    return credit.compare(sokoban_store)


def _steps(url: str) -> pl.DataFrame:
    store = Store(url)
    return pl.concat([pl.from_arrow(t) for _, t in store.iter_valid_shards(store.list_shards())])


def test_the_four_estimators_are_compared_on_every_step(sokoban_store, comparison):
    steps = _steps(sokoban_store)
    names = [r["estimator"] for r in comparison.rows]
    assert names == ["GRPO", "GiGPO", "GAGPO λ=0", "GAGPO λ=0.8"]
    assert comparison.steps == steps.height
    for row in comparison.rows:
        assert row["steps"] == steps.height  # every stored step, recomputed
        assert 0.0 <= row["zero_share"] <= 1.0 and row["iqr"] >= 0.0
        # committed where SQL sees them: one table per shard under advantages/<tag>/
        written = list((Path(sokoban_store) / "advantages" / row["tag"]).glob("*.parquet"))
        assert len(written) == len(Store(sokoban_store).list_shards())


def test_grpo_gives_no_credit_on_an_all_fail_group(sokoban_store, comparison):
    steps = _steps(sokoban_store)
    fail = steps.group_by(C.GROUP_ID).agg(won=pl.col(C.WON).any()).filter(~pl.col("won"))
    assert fail.height >= 1  # the untrained policy fails whole groups
    grpo = comparison.advantages["GRPO"].join(fail.select(C.GROUP_ID), on=C.GROUP_ID)
    assert grpo.height == steps.join(fail.select(C.GROUP_ID), on=C.GROUP_ID).height
    zero_share = float((grpo[C.ADVANTAGE].abs() < credit.ZERO).mean())
    assert zero_share == 1.0
    # while the grouped value proxy still tells the states of those rollouts apart
    gagpo = comparison.advantages["GAGPO λ=0.8"].join(fail.select(C.GROUP_ID), on=C.GROUP_ID)
    assert (gagpo[C.ADVANTAGE].abs() >= credit.ZERO).any()


def test_zero_share_iqr_and_auc_by_hand(comparison):
    for row in comparison.rows:
        adv = comparison.advantages[row["estimator"]]
        x = adv[C.ADVANTAGE].to_numpy()
        assert row["zero_share"] == pytest.approx(float(np.mean(np.abs(x) < 1e-6)))
        q1, q3 = np.quantile(x, [0.25, 0.75])
        assert row["iqr"] == pytest.approx(q3 - q1)
        scored = comparison.labelled.join(adv, on=[C.TRAJ_ID, C.STEP])
        s, y = scored[C.ADVANTAGE].to_numpy(), scored["optimal"].to_numpy()
        pos, neg = s[y], s[~y]
        assert len(pos) and len(neg)  # both kinds of move were played
        pairs = (pos[:, None] > neg[None, :]) + 0.5 * (pos[:, None] == neg[None, :])
        assert row["auc"] == pytest.approx(float(pairs.mean()))
        # within a state: only the pairs of moves made from one state of one group
        wins = count = 0.0
        for _, pool in scored.group_by([C.GROUP_ID, C.STATE_KEY]):
            a, o = pool[C.ADVANTAGE].to_numpy(), pool["optimal"].to_numpy()
            p, n = a[o], a[~o]
            wins += float(((p[:, None] > n[None, :]) + 0.5 * (p[:, None] == n[None, :])).sum())
            count += len(p) * len(n)
        assert count > 0  # some state saw both an optimal and another move
        assert row["state_auc"] == pytest.approx(wins / count)


def test_the_printed_sql_reproduces_the_table(sokoban_store, comparison):
    from gagpo.inspection.sql import close_store_db, open_store_db, run_query

    con = open_store_db(sokoban_store)
    try:
        by_tag = {r["estimator"]: r for r in run_query(con, credit.SQL_QUERY).to_pylist()}
    finally:
        close_store_db(con)
    for row in comparison.rows:
        sql = by_tag[row["tag"]]
        assert sql["steps"] == row["steps"]
        assert sql["zero_share"] == pytest.approx(row["zero_share"])
        assert sql["iqr"] == pytest.approx(row["iqr"])


def test_oracle_labels_the_solver_moves():
    from gagpo.envs import step_oracle
    from gagpo.envs.sokoban import moves_to_go, parse_grid, push, render, solve

    oracle = step_oracle("sokoban")  # declared by the class, found without naming it here
    assert oracle is not None and step_oracle("household") is None
    grid = "#####\n#@$.#\n#___#\n#___#\n#####"  # one push right solves it
    assert moves_to_go(grid) == 1 and oracle.optimal_moves(grid) == {"right"}
    assert moves_to_go(render(push(parse_grid(grid), "right"))) == 0  # solved: no label
    assert oracle.optimal_moves(render(push(parse_grid(grid), "right"))) == frozenset()
    stuck = "#####\n#$@.#\n#___#\n#___#\n#####"  # the box in a corner: unsolvable
    assert moves_to_go(stuck) is None and solve(parse_grid(stuck), 8) is None
    assert oracle.parse_move("Action: right") == "right" and oracle.parse_move("jump") is None


def test_figure_and_closing_lines(sokoban_store, comparison, tmp_path):
    traj = credit.pick_trajectory(comparison)
    assert traj is not None
    labelled = comparison.labelled.filter(pl.col(C.TRAJ_ID) == traj)
    assert labelled["optimal"].any() and not labelled["optimal"].all()
    path = credit.credit_figure(comparison, traj, tmp_path / "credit.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    from gagpo.actors.config import ActorConfig
    from gagpo.workflows.run import RunConfig, after_run

    actors = ActorConfig(store=sokoban_store, env="sokoban")
    text = after_run(sokoban_store, RunConfig(report=False), actors, None, echo=lambda s: None)
    lines = text.splitlines()
    assert "credit on this run's own" in text and "zero_advantage" in text
    assert any(line.startswith("GRPO ") for line in lines)
    assert f'gagpo sql --store {sokoban_store} "{credit.SQL_QUERY}"' in text
    assert lines[-1].startswith(f"credit figure: {Path(sokoban_store) / 'report' / 'credit.png'}")
    assert (Path(sokoban_store) / "report" / "credit.png").is_file()


def test_run_summary_rows_carry_their_tasks_and_interval(sokoban_store):
    from gagpo.workflows.run import summary

    text = summary(sokoban_store)
    header = next(line for line in text.splitlines() if line.startswith("policy_version"))
    assert header.split()[:3] == ["policy_version", "tasks", "rollouts"] and "95%" in header
    row = text.splitlines()[text.splitlines().index(header) + 1].split()
    assert row[:3] == ["0", "4", "16"]  # 4 tasks, 16 rollouts at v0
    steps = _steps(sokoban_store)
    wins = steps.filter(pl.col(C.WON)).height
    low, high = wilson(wins, 16)
    assert f"[{low:.1%}," in text and f"{high:.1%}]" in text


def test_a_non_sokoban_store_is_refused_in_one_line(tmp_path):
    store = Store(str(tmp_path / "s"))
    store.write_shard(make_steps(), group_size=3)
    with pytest.raises(GagpoError, match="sokoban"):
        credit.compare(str(tmp_path / "s"))


# --- the intervals -----------------------------------------------------------------------


def test_wilson_interval_known_values():
    assert wilson(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    low, high = wilson(0, 10)
    assert low == 0.0 and high == pytest.approx(0.2775, abs=1e-4)
    assert wilson(10, 10)[1] == pytest.approx(1.0) and wilson(0, 0) == (0.0, 1.0)
    low, high = wilson(205, 512)  # the bounds solve |p - q| = z·√(q(1-q)/n) for q
    for q in (low, high):
        assert abs(205 / 512 - q) == pytest.approx(1.959964 * math.sqrt(q * (1 - q) / 512))
    assert wilson(307, 512) == pytest.approx((1 - high, 1 - low))  # symmetric


def test_change_is_points_with_the_interval_of_the_difference():
    delta, half = difference(0.40, 512, 0.498, 512)
    assert delta == pytest.approx(0.098)
    assert half == pytest.approx(1.96 * math.sqrt(0.4 * 0.6 / 512 + 0.498 * 0.502 / 512), rel=1e-3)
    assert change_line(0.40, 512, 0.498, 512) == f"+9.8 points (±{100 * half:.1f})"
    assert change_line(0.5, 100, 0.45, 100).startswith("-5.0 points (±")


def test_heldout_table_and_change_line():
    from gagpo.workflows.evaluate import change, table

    rows = [
        {
            "policy_version": 0,
            "rollouts": 512,
            "success_rate": 0.4,
            "valid_rate": 0.9,
            "mean_return": 1.0,
        },
        {
            "policy_version": 100,
            "rollouts": 512,
            "success_rate": 0.498,
            "valid_rate": 0.9,
            "mean_return": 2.0,
        },
    ]
    printed = table(rows, 64, 8)
    low, high = wilson(0.4 * 512, 512)
    assert f"[{low:.1%}, {high:.1%}]" in printed.splitlines()[2]
    line = change(rows)
    assert line.startswith("held-out success: v0 40.0% [")
    assert "→ v100 49.8% [" in line and line.endswith(change_line(0.4, 512, 0.498, 512))


# --- the shipped warm start ----------------------------------------------------------------


def _demo_warmstart_config():
    from gagpo.workflows.recipe import load_recipe

    return load_recipe("demo", "-").warmstart


def test_the_shipped_demo_warm_start_matches_the_code_and_the_recipe():
    """The shipped folder is what `python -m gagpo.workflows.ship_warmstart demo` writes for
    the current code and recipe: its cache key is the one computed now (settings, the tiny
    preset's content hash, sokoban's revision, WARMSTART_FORMAT), its settings are the
    recipe's, and every file is the one its MANIFEST names. Fails after a change that moves
    the key, until the documented command has rebuilt it."""
    from gagpo.workflows import warmstart as ws

    cfg = _demo_warmstart_config()
    shipped = ws.shipped_warmstart(ws.cache_key(cfg))
    assert shipped == ws.shipped_root() / "demo", (
        "the shipped demo warm start is stale: python -m gagpo.workflows.ship_warmstart demo"
    )
    info = json.loads((shipped / ws.INFO_FILE).read_text())
    assert info["config"] == cfg.model_dump(mode="json")
    assert json.loads((shipped / ws.MANIFEST).read_text()) == ws.manifest(shipped)
    assert sum(p.stat().st_size for p in shipped.rglob("*") if p.is_file()) < 2**20  # < 1 MiB


def test_every_shipped_file_is_package_data():
    import fnmatch
    import tomllib

    from gagpo.workflows import warmstart as ws

    root = Path(__file__).resolve().parents[1]
    pyproject = tomllib.loads((root / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["gagpo.workflows.recipes"]
    recipes = ws.shipped_root().parent
    files = [p.relative_to(recipes).as_posix() for p in ws.shipped_root().rglob("*") if p.is_file()]
    assert files and all(any(fnmatch.fnmatch(f, pat) for pat in patterns) for f in files)


def test_a_first_run_copies_the_shipped_warm_start_instead_of_building(tmp_path, monkeypatch):
    from gagpo.workflows import warmstart as ws

    cfg = _demo_warmstart_config()
    key = ws.cache_key(cfg)
    monkeypatch.setattr(ws, "warmstart_root", lambda: tmp_path / "warmstart")
    monkeypatch.setattr(ws, "_build", lambda *a: pytest.fail("built instead of copied"))
    lines: list[str] = []
    policy = ws.warmstart(cfg, echo=lines.append)
    assert policy == tmp_path / "warmstart" / key / ws.POLICY_DIR
    assert "shipped with the package" in lines[0]
    shipped = ws.shipped_root() / "demo"
    assert (policy / "model.safetensors").read_bytes() == (
        shipped / ws.POLICY_DIR / "model.safetensors"
    ).read_bytes()
    assert ws.warmstart(cfg, echo=lines.append) == policy and "cached at" in lines[-1]


def test_a_tampered_shipped_warm_start_is_refused(tmp_path, monkeypatch):
    import shutil

    from gagpo.workflows import warmstart as ws

    fake = tmp_path / "warmstarts"
    shutil.copytree(ws.shipped_root(), fake)
    with (fake / "demo" / ws.POLICY_DIR / "config.json").open("a") as f:
        f.write(" ")
    key = json.loads((fake / "demo" / ws.INFO_FILE).read_text())["key"]
    monkeypatch.setattr(ws, "shipped_root", lambda: fake)
    monkeypatch.setattr(ws, "cache_key", lambda c: key)
    monkeypatch.setattr(ws, "warmstart_root", lambda: tmp_path / "cache")
    with pytest.raises(GagpoError, match="does not match its MANIFEST"):
        ws.warmstart(_demo_warmstart_config(), echo=lambda s: None)
    assert not (tmp_path / "cache" / key).exists()  # nothing half-copied


def test_the_ship_command_writes_what_is_shipped(tmp_path, monkeypatch):
    """`python -m gagpo.workflows.ship_warmstart demo` over a cached build of the current key
    writes exactly the shipped files (the SFT itself is left out: ten minutes on 2 cores)."""
    import shutil

    from gagpo.workflows import ship_warmstart
    from gagpo.workflows import warmstart as ws

    committed = ws.shipped_root() / "demo"
    key = ws.cache_key(_demo_warmstart_config())
    cache = tmp_path / "cache"
    shutil.copytree(committed, cache / key, ignore=shutil.ignore_patterns(ws.MANIFEST))
    monkeypatch.setattr(ws, "warmstart_root", lambda: cache)
    monkeypatch.setattr(ship_warmstart, "shipped_root", lambda: tmp_path / "warmstarts")
    lines: list[str] = []
    target = ship_warmstart.ship("demo", echo=lines.append)
    assert target == tmp_path / "warmstarts" / "demo" and lines[0].startswith("warm start: cached")
    assert (target / ws.MANIFEST).read_text() == (committed / ws.MANIFEST).read_text()
    assert ws.manifest(target) == ws.manifest(committed)
    with pytest.raises(SystemExit, match="usage"):
        ship_warmstart.main([])
