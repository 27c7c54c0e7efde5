"""The Starlette app of `gagpo view`: pages, JSON endpoints and the packaged assets.

Starlette runs the plain (non-async) endpoints below in its thread pool, so a slow query
never blocks the event loop; `StoreSession` serialises the queries of one store. Pages
are static HTML shells (static/*.html) whose scripts ask the JSON endpoints; a page that
names a group checks it exists first, so a bad id is a 404 like any other. Nothing but
the routes below and the files packaged in static/ is ever served: no path from a URL
reaches a file system.

Every error is one line of text with a 4xx status (400 a bad parameter, 404 nothing of
that name, 401/403 from access.py); an unexpected failure is a 500 of one line (uvicorn
logs its traceback on the server's console, never in the page).
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from gagpo.inspection.arguments import VIEW_TIMEOUT_S
from gagpo.inspection.sql import Limits
from gagpo.inspection.view import data, pools
from gagpo.inspection.view.access import Guard, check_bind, is_loopback
from gagpo.schemas.errors import GagpoError

STATIC = "gagpo.inspection.view"  # the package whose static/ folder holds the assets
TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".txt": "text/plain; charset=utf-8",
}
ESTIMATOR_PARAMS = {
    "gamma": float,
    "lam": float,
    "eps": float,
    "omega": float,
    "omega_episode": float,
    "norm": str,
    "state_grouping": str,
    "variant": str,
    "step_std": bool,
}
DEFAULT_COMPARE = "grpo,gigpo,gagpo_lambda0,gagpo"
MAX_SHOWN_ROWS = 1000  # rows of a SQL result shown as a table (the CSV holds all)


def load_assets() -> dict[str, tuple[bytes, str]]:
    """name → (bytes, content type) of every file in static/, read once at start."""
    folder = resources.files(STATIC) / "static"
    assets = {}
    for entry in folder.iterdir():
        suffix = "." + entry.name.rsplit(".", 1)[-1] if "." in entry.name else ""
        if entry.is_file() and suffix in TYPES:
            assets[entry.name] = (entry.read_bytes(), TYPES[suffix])
    return assets


class JSON(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return json.dumps(data.plain(content), allow_nan=False, separators=(",", ":")).encode()


def one_line(status: int, text: str) -> PlainTextResponse:
    line = " ".join(str(text).split()) or "error"
    return PlainTextResponse(line + "\n", status_code=status)


def create_app(
    stores: list[data.StoreSession],
    *,
    host: str = "127.0.0.1",
    token: str | None = None,
    sql_limits: Limits | None = None,
    oracle: data.StepOracle | None = None,
) -> Any:
    """The ASGI app over `stores` (the first is the default), guarded for `host`; with
    `oracle`, the compare page shows which moves were optimal and each estimator's credit
    AUC (workflows/view.py passes Sokoban's solver)."""
    check_bind(host, token)
    if not stores:
        raise GagpoError("no store given; accepted: --store PATH (repeatable)")
    site = _Site(stores, load_assets(), sql_limits or Limits(timeout_s=VIEW_TIMEOUT_S), oracle)
    routes = _page_routes(site) + _data_routes(site) + _sql_routes(site)
    handlers = {HTTPException: _http_error, GagpoError: _user_error, Exception: _server_error}
    app = Starlette(routes=routes, exception_handlers=handlers)  # type: ignore[arg-type]
    app.state.stores = stores
    return Guard(app, token=token, loopback=is_loopback(host))


class _Site:
    """What every route reads: the stores served (the first is the default, `?store=LABEL`
    picks another), the packaged assets, the limits of a typed SQL query, and the compare
    page's oracle."""

    def __init__(self, stores, assets, sql_limits: Limits, oracle) -> None:
        self.stores: list[data.StoreSession] = stores
        self.by_label = {s.label: s for s in stores}
        self.assets: dict[str, tuple[bytes, str]] = assets
        self.sql_limits = sql_limits
        self.oracle: data.StepOracle | None = oracle

    def store_of(self, request: Request) -> data.StoreSession:
        """The store the request names, or the default; an unknown label is a 404."""
        label = request.query_params.get("store") or self.stores[0].label
        if label not in self.by_label:
            accepted = ", ".join(self.by_label)
            raise data.NotFound(f"store {label!r} is not served; accepted: {accepted}")
        return self.by_label[label]

    def asset(self, name: str) -> Response:
        """A packaged file of static/ as it was read at start, with its content type."""
        body, kind = self.assets[name]
        return Response(body, media_type=kind)


def _page_routes(site: _Site) -> list[Route]:
    """The HTML shells and their scripts and styles. A page that names a group (/group,
    /compare) checks the group exists first, so a bad id is a 404 before any script runs;
    /static serves the packaged assets by name, never a page and never a path."""

    def group_page(request: Request) -> Response:
        group = request.query_params.get("group")
        if group:
            store = site.store_of(request)
            gid = data.check_id(group, "group")
            if not store.query("SELECT 1 FROM steps WHERE group_id = ? LIMIT 1", [gid]):
                raise data.NotFound(f"group {gid!r} is not in store {store.label!r}")
        return site.asset("compare.html" if request.url.path == "/compare" else "group.html")

    def static(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in site.assets or name.endswith(".html"):
            raise data.NotFound(f"no asset {name!r}")
        return site.asset(name)

    def shell(name: str):
        """A handler answering the packaged page `name`: a page without a parameter to check."""
        return lambda request: site.asset(name)

    return [
        Route("/", shell("run.html")),
        Route("/run", shell("run.html")),
        Route("/group", group_page),
        Route("/compare", group_page),
        Route("/sql", shell("sql.html")),
        Route("/pools", shell("pools.html")),
        Route("/static/{name}", static),
    ]


def _data_routes(site: _Site) -> list[Route]:
    """The JSON endpoints the pages' scripts ask: the stores served, a run's summary, the
    group list (filtered by version and task, ordered, at most 1000), the choices the
    pickers offer, one group under one estimator, a group under several (the compare
    page, its parameters shared and each estimator given those it takes) and the pools."""

    def api_stores(request: Request) -> Response:
        return JSON([{"label": s.label, "url": s.url} for s in site.stores])

    def api_run(request: Request) -> Response:
        return JSON(data.run_data(site.store_of(request)))

    def api_groups(request: Request) -> Response:
        q = request.query_params
        version = _int(q.get("version"), "version")
        limit = _int(q.get("limit"), "limit")
        limit = 50 if limit is None else limit
        if not 1 <= limit <= 1000:
            raise GagpoError(f"limit {limit} is out of range; accepted: 1 to 1000")
        return JSON(
            data.group_list(
                site.store_of(request),
                version=version,
                task=q.get("task") or None,
                order=q.get("order") or "spread",
                limit=limit,
            )
        )

    def api_choices(request: Request) -> Response:
        return JSON(data.choices(site.store_of(request)))

    def api_group(request: Request) -> Response:
        q = request.query_params
        group = q.get("group") or ""
        choice = q.get("estimator") or "gagpo"
        return JSON(data.group_view(site.store_of(request), group, choice, _params(q)))

    def api_compare(request: Request) -> Response:
        q = request.query_params
        given = q.get("estimators")
        names = [n for n in (given if given is not None else DEFAULT_COMPARE).split(",") if n]
        if not 1 <= len(names) <= 8:
            raise GagpoError("estimators: accepted: 1 to 8 names separated by commas")
        params = _params(q)
        chosen = [(n, _params_for(n, params)) for n in names]
        return JSON(
            data.compare_view(
                site.store_of(request),
                q.get("group") or "",
                chosen,
                oracle=site.oracle,
                traj_id=q.get("traj") or None,
            )
        )

    def api_pools(request: Request) -> Response:
        return JSON(pools.pools_view(site.store_of(request)))

    return [
        Route("/api/stores", api_stores),
        Route("/api/run", api_run),
        Route("/api/groups", api_groups),
        Route("/api/choices", api_choices),
        Route("/api/group", api_group),
        Route("/api/compare", api_compare),
        Route("/api/pools", api_pools),
    ]


def _sql_routes(site: _Site) -> list[Route]:
    """The SQL page's two endpoints, both under `site.sql_limits`: a POSTed query answers
    the first MAX_SHOWN_ROWS rows as JSON (the cells as the CSV writes them, with the total
    count), and /api/sql.csv downloads every row. The POST is async only to read its body;
    the query itself runs in the thread pool."""

    async def api_sql(request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            raise GagpoError('the body is not JSON; accepted: {"query": "SELECT …"}') from None
        query = body.get("query") if isinstance(body, dict) else None
        if not isinstance(query, str):
            raise GagpoError('the body has no query; accepted: {"query": "SELECT …"}')
        store = site.store_of(request)

        table = await run_in_threadpool(_sql, store, query, site.sql_limits)
        columns, rows = _csv_rows(table)
        return JSON(
            {
                "columns": columns,
                "rows": rows[:MAX_SHOWN_ROWS],
                "total": len(rows),
                "group_column": "group_id" in columns,
            }
        )

    def api_sql_csv(request: Request) -> Response:
        store, query = site.store_of(request), request.query_params.get("query") or ""
        text = _csv_text(_sql(store, query, site.sql_limits))
        return Response(
            text,
            media_type="text/csv; charset=utf-8",
            headers={"content-disposition": 'attachment; filename="gagpo-sql.csv"'},
        )

    return [
        Route("/api/sql", api_sql, methods=["POST"]),
        Route("/api/sql.csv", api_sql_csv),
    ]


def _sql(store: data.StoreSession, query: str, limits: Limits):
    if not query.strip().strip(";").strip():
        raise GagpoError('the query is empty; accepted: SQL such as "SELECT count(*) FROM steps"')
    return store.fresh_query(query, limits)


def _csv_text(table) -> str:
    """The result as `gagpo sql --format csv` writes it."""
    from gagpo.inspection.cli import render_csv

    return render_csv(table)


def _csv_rows(table) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the CSV text: the table shows exactly what the download holds."""
    import csv
    import io

    if table.num_columns == 0:
        return [], []
    lines = list(csv.reader(io.StringIO(_csv_text(table))))
    return lines[0], lines[1:]


def _int(text: str | None, name: str) -> int | None:
    if text is None or text == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise GagpoError(f"{name} {text[:40]!r} is not an integer") from None


def _params(q) -> dict[str, Any]:
    """The estimator parameters given in the query string, typed."""
    out: dict[str, Any] = {}
    for name, kind in ESTIMATOR_PARAMS.items():
        text = q.get(name)
        if text is None or text == "":
            continue
        if kind is float:
            try:
                out[name] = float(text)
            except ValueError:
                raise GagpoError(f"{name} {text[:40]!r} is not a number") from None
        elif kind is bool:
            if text not in ("true", "false"):
                raise GagpoError(f"{name} {text[:40]!r}: accepted: true, false")
            out[name] = text == "true"
        else:
            out[name] = text
    return out


# Which of the shared parameters each estimator takes (the compare page sends one set).
_TAKES = {
    "gagpo": {"gamma", "lam", "norm", "eps", "state_grouping", "omega_episode"},
    "gagpo_lambda0": {"gamma", "norm", "eps", "state_grouping", "omega_episode"},
    "gagpo_lambda1": {"gamma", "norm", "eps", "state_grouping", "omega_episode"},
    "gigpo": {"gamma", "norm", "eps", "state_grouping", "omega", "step_std", "variant"},
    "grpo": {"gamma", "norm", "eps", "state_grouping"},
    "rloo": {"gamma", "eps", "state_grouping"},
}


def _params_for(name: str, params: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in params.items() if k in _TAKES.get(name, ())}


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        return one_line(
            404,
            f"not found: {request.url.path[:200]} is not a page of gagpo view "
            "(pages: /, /group, /compare, /pools, /sql)",
        )
    return one_line(exc.status_code, exc.detail or "refused")


async def _user_error(request: Request, exc: Exception) -> Response:
    return one_line(404 if isinstance(exc, data.NotFound) else 400, str(exc))


async def _server_error(request: Request, exc: Exception) -> Response:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return one_line(500, f"internal error ({type(exc).__name__}: {first[:200]})")
