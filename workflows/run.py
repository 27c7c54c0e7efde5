"""`gagpo run`: actors and learner together, from a TOML recipe.

It reads top to bottom: the recipe, read once and checked as one model
(workflows/recipe.py) → the plan (workflows/layout.py) → the warm start →
`launcher.run(plan)` → what follows the run. The launcher (workflows/launch.py) starts the
processes here, or places them with Ray (--ray), and ends them all. They talk only through
the store, exactly as on separate machines: the actors roll out with `--follow` and pick up
each published version; when the learner has made its updates the actors are stopped
(SIGTERM: each finishes its group and commits it) and a summary of the run is printed from
the store's SQL views, followed by the held-out evaluation, where its report (`gagpo
report`) is and, on an environment with a step oracle, the credit comparison. A recipe's
[warmstart] table is built first (or taken from the cache, workflows/warmstart.py) and
becomes the base policy of both sides. The store is opened once, when the run starts (a
dry run opens nothing), and passed down. Ctrl-C (or SIGTERM) stops every process started
here, by its pid, and nothing else.
"""

from __future__ import annotations

import signal
from pathlib import Path

from gagpo.actors.config import ActorConfig
from gagpo.schemas.errors import GagpoError
from gagpo.schemas.layout import new_id
from gagpo.schemas.overrides import split_sections
from gagpo.storage.store import Store
from gagpo.workflows.recipe import SET_TABLES, RunConfig, load_recipe, recipe_path
from gagpo.workflows.warmstart import WarmstartConfig, warmstart

SUMMARY_ROWS = 15  # rows of the printed per-version table, at most


def check_store_path(store: str) -> None:
    """A local store is a folder, or a path where one can be made: a path that is (or
    lies under) a file is refused, as the run would refuse it, without creating anything."""
    if "://" in store and not store.startswith("file://"):
        return  # an object store: the run checks it when it writes
    path = Path(store.removeprefix("file://")).expanduser()
    for here in (path, *path.parents):
        if here.exists():
            if not here.is_dir():
                what = "is a file" if here == path else f"lies under the file {str(here)!r}"
                raise GagpoError(
                    f"store {store!r} {what}; accepted: a folder (created when "
                    "missing) or an fsspec URL (s3://…)"
                )
            return


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def run(
    recipe: str,
    store: str,
    *,
    actors: int | None = None,
    echo=print,
    sets=(),
    warm: bool = True,
    dry_run: bool = False,
    ray: str | None = None,
) -> int:
    """Run a recipe into `store` (its warm start first, cached); return the learner's exit
    code (130 when interrupted). Every process started here is ended before returning.
    `sets` are `--set` items TABLE.KEY=VALUE (TABLE: run, actors, learner), passed on to
    each process."""
    path = recipe_path(recipe)
    config = _checked_recipe(path, store, sets, actors)
    from gagpo.workflows.launch import launcher_for

    warm_cfg = config.warmstart if warm else None
    run_id = new_id()
    plan = _planner(path, store, config, sets, run_id)
    if dry_run:  # nothing opened, nothing started
        launcher = launcher_for(ray, config.run, store, run_id, echo)
        echo(launcher.describe(plan(_cached_warmstart_flags(warm_cfg))))
        return 0
    opened = Store(store)
    launcher = launcher_for(ray, config.run, opened, run_id, echo)
    launcher.check(plan([]))  # an impossible placement fails before the warm start is built
    opened.ensure_writable()
    code = _launch(launcher, plan, warm_cfg, echo)
    from gagpo.learner.cli import EXIT_STOPPED_EARLY

    if code in (0, EXIT_STOPPED_EARLY):  # stopped early: the learner said why; show what ran
        _what_ran(opened, store, config, launcher, echo)
    return code


def _checked_recipe(path: Path, store: str, sets, actors: int | None):
    """The whole recipe, read and checked now (with the store path and the environment), so
    a bad one fails before any process starts; a dry run checks all that the run checks
    before it starts anything."""
    config = load_recipe(path, store, sets=sets, actors=actors)
    check_store_path(store)
    from gagpo.envs import check_env

    check_env(config.actors.env, dict(config.actors.env_options))
    return config


def _planner(path: Path, store: str, config, sets, run_id: str):
    """The plan as a function of the policy flags (the warm start's `--policy`, known only
    once it is built): each side gets its own tables' `--set` items, and the learner keeps
    every version the held-out evaluation will read."""
    from gagpo.workflows.layout import plan_run

    by_table = split_sections(sets, SET_TABLES)
    actor_args = [arg for item in by_table["actors"] for arg in ("--set", item)]
    learner_args = [arg for item in by_table["learner"] for arg in ("--set", item)]
    if config.run.eval_groups and not config.learner.keep_every:  # keep what will be evaluated
        learner_args += ["--set", f"keep_every={config.run.eval_every}"]

    def plan(policy_flags: list[str]):
        return plan_run(
            path,
            store,
            config.run,
            config.actors,
            config.learner,
            actor_args=policy_flags + actor_args,
            learner_args=policy_flags + learner_args,
            run_id=run_id,
        )

    return plan


def _launch(launcher, plan, warm_cfg: WarmstartConfig | None, echo) -> int:
    """Build the warm start (or take it from the cache), then run the plan with it; the
    launcher's exit code, or 130 after Ctrl-C or SIGTERM, which stop every process started.

    SIGTERM ends us like Ctrl-C. SIGINT is handled explicitly too: a shell starts background
    jobs with SIGINT ignored, and the children would inherit that and ignore our SIGINT.
    Both handlers are restored on the way out."""
    previous = {
        signal.SIGTERM: signal.signal(signal.SIGTERM, _raise_interrupt),
        signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler),
    }
    try:
        policy_flags = []
        if warm_cfg is not None:
            policy_flags = ["--policy", str(warmstart(warm_cfg, echo=echo))]
        return launcher.run(plan(policy_flags))
    except KeyboardInterrupt:
        echo("interrupted: every process started was stopped; committed shards are kept")
        return 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _what_ran(opened: Store, store: str, config, launcher, echo) -> None:
    """After a run that ended well (or stopped early): the summary from the store's SQL
    views, what follows it (evaluation, report, credit), how to browse the store, and the
    launcher's own closing lines."""
    echo(summary(opened))
    echo(after_run(opened, config.run, config.actors, config.learner.estimator, echo))
    echo(f"browse it (pip install 'gagpo[view]'): gagpo view --store {store}")
    for line in launcher.after():
        echo(line)


def _cached_warmstart_flags(warm_cfg: WarmstartConfig | None) -> list[str]:
    """Where the warm start is (or would be) cached, as the dry run shows it; nothing built."""
    if warm_cfg is None:
        return []
    from gagpo.workflows.warmstart import POLICY_DIR, cache_key, warmstart_root

    return ["--policy", str(warmstart_root() / cache_key(warm_cfg) / POLICY_DIR)]


def _group_use(con, store) -> str:
    """What became of the generated groups: trained, dropped as stale (the share that
    backpressure keeps small, actors/throttle.py) or never read, from the ledger."""
    from gagpo.inspection.sql import run_query
    from gagpo.learner.feed import STALE, TRAINED, Ledger

    generated = run_query(con, "select count(*) as n from groups").to_pylist()[0]["n"]
    status = Ledger.load(store).table()["status"].to_pylist()
    trained, stale = status.count(TRAINED), status.count(STALE)
    return (
        f"groups: {generated} generated, {trained} trained, {stale} dropped as stale "
        f"({stale / max(generated, 1):.1%} of generated), "
        f"{max(generated - trained - stale, 0)} never read"
    )


def summary(store: Store | str) -> str:
    """Success rate, valid replies and return per policy version, from the store's SQL views."""
    from gagpo.inspection.sql import close_store_db, open_store_db

    opened = _opened(store)
    con = open_store_db(opened)
    try:
        return _summary(con, opened)
    finally:
        close_store_db(con)


def _summary(con, store: Store) -> str:
    from gagpo.inspection.intervals import wilson
    from gagpo.inspection.sql import run_query

    top = run_query(con, "select max(policy_version) as v from trajectories").to_pylist()[0]["v"]
    # Long runs: consecutive versions share a row (at most SUMMARY_ROWS), so a row holds
    # enough rollouts for its rate to mean something.
    width = max(1, -(-((top or 0) + 1) // SUMMARY_ROWS))
    table = run_query(
        con,
        f"select policy_version // {width} as bucket, min(policy_version) as first, "
        "max(policy_version) as last, count(*) as rollouts, "
        "count(distinct group_id) as tasks, count(*) filter (where success) as successes, "
        "avg(success::int) as success_rate, "
        "1 - sum(invalid_actions)::double / sum(length)::double as valid_rate, "
        'avg("return") as mean_return from trajectories group by 1 order by 1',
    ).to_pylist()
    lines = [
        "run summary: success (95% Wilson interval), valid replies and return per policy "
        "version of the training rollouts; each row's tasks differ, so rows of few tasks "
        "are not comparable on their own",
        "policy_version  tasks  rollouts  success_rate  95% interval      valid_replies  mean_return",
    ]
    for row in table:
        first, last = row["first"], row["last"]
        label = str(first) if first == last else f"{first}-{last}"
        low, high = wilson(row["successes"], row["rollouts"])
        lines.append(
            f"{label:>14}  {row['tasks']:>5}  {row['rollouts']:>8}  {row['success_rate']:>12.1%}  "
            f"{f'[{low:.1%}, {high:.1%}]':<16}  {row['valid_rate']:>13.1%}  "
            f"{row['mean_return']:>11.3f}"
        )
    lines.append(_group_use(con, store))
    lines.append(f"store: {store.url}  (inspect with: gagpo sql --store {store.url})")
    return "\n".join(lines)


def after_run(
    store: Store | str, config: RunConfig, actor_cfg: ActorConfig, estimator, echo
) -> str:
    """What follows the run summary: the held-out evaluation, the report, the credit
    comparison (when the run's steps are of an environment with a step oracle), then the
    closing lines: held-out v0 → last with its interval, the credit table, where the report
    and the credit figure are."""
    store = _opened(store)
    heldout, credit, written = [], [], []
    if config.eval_groups:
        from gagpo.workflows.evaluate import change, evaluate_run, table

        rows = evaluate_run(
            store,
            actor_cfg,
            groups=config.eval_groups,
            every=config.eval_every,
            seed=config.eval_seed,
            echo=echo,
        )
        if rows:
            echo(table(rows, config.eval_groups, actor_cfg.group_size))
            heldout = [change(rows)]
    if config.report:
        written = [report(store)]
    if config.credit:
        credit = credit_lines(store, estimator, echo)
        if credit and credit[-1].startswith("credit figure:"):
            written.append(credit.pop())  # where the figure is, beside the report's
    return "\n".join(["", "─── the run in brief ───", *heldout, *credit, *written])


def credit_lines(store: Store | str, estimator, echo) -> list[str]:
    """The credit comparison of the run's own steps, when their environment declares a step
    oracle (envs/base.py StepOracle); none otherwise."""
    from gagpo.workflows.credit import credit_report, oracle_env

    store = _opened(store)
    try:
        env = oracle_env(store)
        if env is None:
            return []
        echo("credit comparison: recomputing the run's steps under GRPO, GiGPO and GAGPO …")
        return credit_report(store, estimator, report_dir(store), env)[1]
    except GagpoError as exc:  # e.g. no shard committed: say so, the run itself is done
        return [f"credit comparison: skipped ({exc})"]


def report_dir(store: Store) -> Path:
    """Where the run's report goes: STORE/report/, or ./gagpo-report for a remote store."""
    from gagpo.schemas import layout

    return Path(layout.report_dir(store.root)) if store.is_local else Path("gagpo-report")


def report(store: Store) -> str:
    """Write `gagpo report` for the store; say where it and its learning curve are."""
    from gagpo.inspection.report import write_report

    out = report_dir(store)
    written = write_report(store, out)
    curve = next((f for f in written.figures if f.name == "learning_curves.png"), None)
    lines = [f"report: {written.summary}"]
    if curve is not None:
        lines.append(f"learning curve: {curve}")
    return "\n".join(lines)


def _opened(store: Store | str) -> Store:
    """The command's opened store; a URL (a test, a notebook) is opened here."""
    return store if isinstance(store, Store) else Store(store)
