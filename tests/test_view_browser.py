"""`gagpo view` in a real headless browser (Debian's chromium under Playwright): the run
page, a group under several estimators, a state's pool, the SQL page and a bad group.

The screenshots of docs/inspect.md (docs/img/view_*.png) are taken here
(GAGPO_SCREENSHOTS=1 writes them into docs/img/)."""

from __future__ import annotations

import csv
import io
import os
import re
from pathlib import Path

import pytest
from playwright.sync_api import Page, sync_playwright

from gagpo.inspection.sql import query_store
from gagpo.inspection.view.app import create_app
from gagpo.inspection.view.data import StoreSession
from gagpo.workflows.view import EnvironmentOracle
from tests.helpers.drift import GROUPS, build_store, kinds
from tests.helpers.view import cli_advantages, cli_csv, serving, view_store

CHROMIUM = "/usr/bin/chromium"  # Debian's (the Makefile installs it); Playwright's own is not used
if not os.access(CHROMIUM, os.X_OK):
    pytest.skip(
        "chromium is not installed (apt-get install chromium): browser tests skipped",
        allow_module_level=True,
    )

__all__ = ["view_store"]  # the fixture, imported for pytest
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]
# The screenshots of docs/inspect.md and the README: written there when
# GAGPO_SCREENSHOTS=1 (to refresh them), else beside the test's temporary files, so a test
# run leaves the checkout as it found it.
DOCS_IMG = Path(__file__).resolve().parents[1] / "docs" / "img"


@pytest.fixture
def img(tmp_path) -> Path:
    return DOCS_IMG if os.environ.get("GAGPO_SCREENSHOTS") == "1" else tmp_path


TIMEOUT_MS = 30_000


@pytest.fixture(scope="module")
def base(view_store: Path):
    app = create_app([StoreSession("demo", str(view_store))], oracle=EnvironmentOracle())
    with serving(app) as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser, base) -> Page:
    context = browser.new_context(viewport={"width": 1500, "height": 1000}, base_url=base)
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    yield page
    context.close()
    assert errors == []


def shown_advantages(page: Page) -> dict[tuple[str, int], float]:
    """(traj_id, step) → the advantage printed in each step's cell (4 decimals)."""
    cells = page.eval_on_selector_all(
        ".step",
        "els => els.map(e => [e.dataset.traj, +e.dataset.step, e.querySelector('.adv').textContent])",
    )
    return {(traj, step): float(text.split()[1]) for traj, step, text in cells}


def choose(page: Page, estimator: str, **fields: str) -> None:
    page.select_option("#estimator", estimator)
    for name, value in fields.items():
        page.fill(f"#{name}", value)
    with page.expect_response(lambda r: "/api/group?" in r.url):
        page.click("#apply")
    page.wait_for_selector(".step")


def test_run_page_to_a_group_and_its_advantages_under_each_estimator(
    page: Page, view_store, tmp_path
):
    page.goto("/")
    page.wait_for_selector("#groups a.group-link")
    assert page.locator(".uplot").count() >= 3  # learning curves and throughput drawn
    link = page.locator("#groups a.group-link").first
    group = link.inner_text()
    link.click()
    page.wait_for_url(re.compile(r"/group\?"))
    page.wait_for_selector(".step")
    assert group in page.inner_text("#title")
    page.screenshot(path=str(tmp_path / "run.png"))

    for estimator, fields, flags in [
        ("grpo", {}, ["--estimator", "grpo"]),
        ("gigpo", {"gamma": "0.9"}, ["--estimator", "gigpo", "--gamma", "0.9"]),
        (
            "gagpo",
            {"gamma": "0.9", "lam": "0.6"},
            ["--estimator", "gagpo", "--gamma", "0.9", "--lam", "0.6"],
        ),
    ]:
        choose(page, estimator, **fields)
        expected = cli_advantages(view_store, group, tmp_path / f"{estimator}.parquet", *flags)
        shown = shown_advantages(page)
        assert shown.keys() == expected.keys()
        for key, value in expected.items():
            assert shown[key] == pytest.approx(round(value, 4), abs=1e-9), (estimator, key)


def test_clicking_a_state_highlights_exactly_its_pool(page: Page, view_store, img: Path):
    tag = query_store(view_store, "SELECT estimator FROM estimators")["estimator"][0].as_py()
    group, state = (
        query_store(
            view_store,
            f"""
        SELECT group_id, state_key FROM state_pools WHERE estimator = '{tag}'
        ORDER BY pool_visits DESC, group_id, state_key LIMIT 1""",
        )
        .to_pylist()[0]
        .values()
    )
    page.goto(f"/group?store=demo&group={group}&estimator=stored:{tag}")
    page.wait_for_selector(".step")
    cell = page.locator(".step", has=page.locator("pre.state", has_text=state)).first
    cell.locator("pre.state").click()
    highlighted = sorted(
        page.eval_on_selector_all(
            ".step.in-pool", "els => els.map(e => [e.dataset.traj, +e.dataset.step])"
        )
    )
    pool = query_store(
        view_store,
        f"""
        SELECT s.traj_id, s.step, p.pool_visits FROM steps s
        JOIN state_pools p ON p.group_id = s.group_id AND p.state_key = s.state_key
        WHERE p.estimator = '{tag}' AND s.group_id = '{group}' AND p.pool_id =
            (SELECT pool_id FROM state_pools WHERE estimator = '{tag}' AND group_id = '{group}'
             AND state_key = '{state.replace("'", "''")}')
        ORDER BY s.traj_id, s.step""",
    ).to_pylist()
    assert highlighted == [[r["traj_id"], r["step"]] for r in pool]
    assert int(page.inner_text("#pool-size")) == pool[0]["pool_visits"] == len(highlighted)
    img.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(img / "view_group.png"))


def test_the_compare_page(page: Page, view_store, img: Path):
    group = query_store(
        view_store,
        "SELECT group_id FROM groups ORDER BY max_return - min_return DESC, group_id LIMIT 1",
    )["group_id"][0].as_py()
    page.goto(f"/compare?store=demo&group={group}")
    page.wait_for_selector("#compare-table td.adv-cell")
    assert page.locator("#summaries tbody tr").count() == 4
    assert "credit AUC" in page.inner_text("#summaries thead")  # Sokoban's solver judged the moves
    assert page.locator("#compare-table td.move.optimal").count() > 0
    page.screenshot(path=str(img / "view_compare.png"))
    traj = page.eval_on_selector("#traj option:nth-child(2)", "o => o.value")
    page.select_option("#traj", traj)  # one rollout: its turns only
    page.wait_for_selector(f"#title:has-text('{traj}')")  # CSP: no string eval in the page
    assert (
        page.locator("#compare-table tbody tr").count()
        == query_store(view_store, f"SELECT count(*) AS n FROM steps WHERE traj_id = '{traj}'")[
            "n"
        ][0].as_py()
    )


def test_the_sql_page_equals_gagpo_sql_csv(page: Page, view_store):
    query = (
        "SELECT group_id, traj_id, step, reward, action_valid, won "
        "FROM steps ORDER BY group_id, traj_id, step LIMIT 40"
    )
    page.goto("/sql")
    page.fill("#query", query)
    page.click("#run-sql")
    page.wait_for_selector("#sql-table tbody tr")
    header = page.eval_on_selector_all("#sql-table th", "els => els.map(e => e.textContent)")
    rows = page.eval_on_selector_all(
        "#sql-table tbody tr", "trs => trs.map(tr => [...tr.cells].map(td => td.textContent))"
    )
    expected = list(csv.reader(io.StringIO(cli_csv(view_store, query))))
    assert [header, *rows] == expected
    page.locator("#sql-table a.group-link").first.click()  # a row's group_id → its group page
    page.wait_for_selector(".step")


def test_a_bad_group_is_a_clean_404(page: Page):
    response = page.goto("/group?group=01nonexistentgroupid")
    assert response is not None and response.status == 404
    text = page.inner_text("body").strip()
    assert "\n" not in text and "is not in store" in text


def test_the_group_page_marks_the_prompt_breaks(browser, tmp_path):
    """Conversations that drift (tests/helpers/drift.py): exactly the steps whose prompt
    does not begin with the previous turn's prompt and action are marked, each with a
    title saying what it means."""
    store = build_store(tmp_path / "drift")
    breaks = {key for key, found in kinds().items() if found == "drift"}
    app = create_app([StoreSession("drift", str(store.root))])
    with serving(app) as url:
        context = browser.new_context(viewport={"width": 1500, "height": 1000}, base_url=url)
        page = context.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto("/group?store=drift&group=g-hand&estimator=grpo")
        page.wait_for_selector(".step")
        marked = page.eval_on_selector_all(
            ".step.prompt-break", "els => els.map(e => [e.dataset.traj, +e.dataset.step])"
        )
        expected = sorted(k for k in breaks if k[0] in GROUPS["g-hand"][1])
        assert sorted(tuple(m) for m in marked) == expected
        assert int(page.inner_text("#prompt-drift")) == len(expected)
        title = page.locator(".step.prompt-break .break-mark").first.get_attribute("title")
        assert title is not None and "does not begin with turn" in title and "drift" in title
        context.close()
        assert errors == []
