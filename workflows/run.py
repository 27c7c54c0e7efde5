"""`gagpo run`: actors and learner together, from a TOML recipe.

It reads top to bottom: the recipe's tables, checked → the plan (workflows/layout.py) →
the warm start → `launcher.run(plan)` → what follows the run. The launcher
(workflows/launch.py) starts the processes here, or places them with Ray (--ray), and
ends them all. They talk only through the store, exactly as on separate machines: the
actors roll out with `--follow` and pick up each published version; when the learner
has made its updates the actors are stopped (SIGTERM: each finishes its group and
commits it) and a summary of the run is printed from the store's SQL views, followed by
the held-out evaluation, where its report (`gagpo report`) is and, on an environment
with a step oracle, the credit comparison. A recipe's [warmstart] table is built first
(or taken from the cache, workflows/warmstart.py) and becomes the base policy of both
sides. Ctrl-C (or SIGTERM) stops every process started here, by its pid, and nothing else.
"""

from __future__ import annotations

import signal
from importlib import resources
from pathlib import Path

from pydantic import Field

from gagpo.actors.config import ActorConfig
from gagpo.schemas.config import Config, load_config, read_toml
from gagpo.schemas.errors import GagpoError
from gagpo.schemas.overrides import merge, parse_sets, split_sections
from gagpo.schemas.suggest import check_keys, unknown
from gagpo.workflows.recipes import shipped as shipped_recipes
from gagpo.workflows.warmstart import WarmstartConfig, warmstart

SUMMARY_ROWS = 15  # rows of the printed per-version table, at most


class RunConfig(Config):
    """The [run] table of a recipe."""

    actors: int = Field(2, ge=1, le=64)
    """Actor processes started beside the learner (with actor_gpus: one per entry)."""
    actor_gpus: list[int] = Field(default_factory=list, max_length=64)
    """GPU of each actor, e.g. [0, 1, 2, 3]; a GPU listed twice holds two actors (each with
    its memory share). Empty: actors run where actors.device says (CPU by default)."""
    learner_gpus: list[int] = Field(default_factory=list, max_length=64)
    """GPUs of the learner: one gives one process, several give torchrun with one rank per
    GPU (learner.parallel: ddp or fsdp). A GPU also in actor_gpus is shared (colocated)."""
    actor_gpu_memory: float | None = Field(None, gt=0.0, le=1.0)
    """Share of its GPU's memory each actor takes; default actors.vllm.gpu_memory_utilization,
    divided between the actors of a GPU that holds several."""
    learner_gpu_memory: float | None = Field(None, gt=0.0, le=1.0)
    """Share of each learner GPU's memory the learner may allocate; default: what the actors
    on it leave (all of it on a GPU of its own)."""
    stop_timeout_s: float = Field(120.0, gt=0.0, le=3600.0)
    """Seconds an actor may take to finish its group after SIGTERM before it is killed."""
    actor_restarts: int = Field(3, ge=0, le=1000)
    """With --ray: times each actor is restarted (fresh run id and seeds) after it died."""
    learner_restarts: int = Field(2, ge=0, le=100)
    """With --ray: times the learner is started again with --resume after it failed."""
    place_timeout_s: float = Field(300.0, gt=0.0, le=86_400.0)
    """With --ray: seconds the cluster may take to place the run, or to place a process again
    after its node was lost (an autoscaling cluster adds nodes meanwhile); then one line."""
    learner_nodes: int = Field(0, ge=0, le=64)
    """With --ray: nodes the learner's ranks span, split evenly; 0: one node if one holds them."""
    report: bool = True
    """Write `gagpo report` (plots and summary.md) into STORE/report/ when the run ends."""
    credit: bool = True
    """On an environment with a step oracle (sokoban), compare the credit of GRPO, GiGPO and
    GAGPO on the run's own steps when it ends (workflows/credit.py: recomputed, no
    training), with a figure beside the report."""
    eval_groups: int = Field(0, ge=0, le=100_000)
    """Held-out evaluation when the run ends (workflows/evaluate.py): each evaluated version
    plays these same tasks (group_size rollouts each); 0: none."""
    eval_every: int = Field(5, ge=1, le=10**9)
    """Evaluate v0, every N-th version and the last (the learner keeps them: learner.keep_every)."""
    eval_seed: int = Field(900_000_000, ge=0, le=2**62)
    """First task seed of the held-out tasks (far from the actors' seeds)."""


def recipe_path(recipe: str) -> Path:
    """A recipe file path, or the name of a recipe shipped in workflows/recipes/."""
    path = Path(recipe)
    if path.suffix == ".toml" or path.exists():
        if not path.is_file():
            raise GagpoError(
                f"recipe {recipe!r} does not exist; accepted: a TOML file or one of {shipped()}"
            )
        return path
    shipped_file = resources.files("gagpo.workflows") / "recipes" / f"{recipe}.toml"
    if not shipped_file.is_file():
        raise GagpoError(f"unknown recipe {recipe!r}; accepted: a TOML file or one of {shipped()}")
    return Path(str(shipped_file))


def shipped() -> str:
    return ", ".join(shipped_recipes())


REQUIRED_TABLES = ("run", "actors", "learner")  # and optionally [warmstart]


def check_recipe(path: Path) -> None:
    """The recipe's tables before any is loaded: each one known ([warmstrat] is refused,
    naming [warmstart], rather than left out of the run), the required ones present, and
    every key of every table a field of its model (a misspelt key names the closest one)."""
    from gagpo.learner.config import LearnerConfig

    models = {
        "run": RunConfig,
        "actors": ActorConfig,
        "learner": LearnerConfig,
        "warmstart": WarmstartConfig,
    }
    data = read_toml(path)
    where = f"recipe {str(path)!r}"
    for name, table in data.items():
        if name not in models:
            raise GagpoError(f"{where}: {unknown(name, list(models), 'table', _table)}")
        if not isinstance(table, dict):
            raise GagpoError(f"{where}: '{name}' must be a table ([{name}]), not {table!r}")
        check_keys(table, models[name], where, name)
    missing = [name for name in REQUIRED_TABLES if name not in data]
    if missing:
        raise GagpoError(
            f"{where} has no {_table(missing[0])} table; accepted: a recipe with the tables "
            "[run], [actors] and [learner] (and optionally [warmstart]), as the shipped ones "
            f"({shipped()})"
        )


def _table(name: str) -> str:
    return f"[{name}]"


def load_table(model, path: Path, table: str, overrides: dict, sets: list[str]):
    """A recipe's table as its config model; an error names the table (and --set, when
    that table was overridden)."""
    try:
        return load_config(model, path, section=table, overrides=overrides)
    except GagpoError as exc:
        given = " with --set" if sets else ""
        raise GagpoError(f"recipe {str(path)!r} [{table}]{given}: {exc}") from None


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


def warmstart_config(path: Path, actor_cfg: ActorConfig) -> WarmstartConfig | None:
    """The recipe's [warmstart] table, or None. What shapes the prompts (environment,
    policy, turn limit, history window, prompt budget) defaults to the [actors] table's,
    so demonstrations are tokenized exactly as the RL actors will present them."""
    table = read_toml(path).get("warmstart")
    if table is None:
        return None
    if not isinstance(table, dict):
        raise GagpoError(f"recipe {str(path)!r}: [warmstart] must be a table")
    inherited = {
        "env": actor_cfg.env,
        "env_options": actor_cfg.env_options,
        "policy": actor_cfg.policy,
        "max_turns": actor_cfg.max_turns,
        "history_window": actor_cfg.history_window,
        "max_prompt_tokens": actor_cfg.sampling.max_prompt_tokens,
    }
    try:
        return load_config(WarmstartConfig, overrides={**inherited, **table})
    except GagpoError as exc:
        raise GagpoError(f"recipe {str(path)!r} [warmstart]: {exc}") from None


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
    check_recipe(path)
    by_table = split_sections(sets, ("run", "actors", "learner"))
    run_sets = parse_sets(by_table["run"], RunConfig)
    config = load_table(
        RunConfig, path, "run", merge(run_sets, {"actors": actors}), by_table["run"]
    )
    # Validate the other tables now, so a bad recipe fails before any process starts; a
    # dry run checks all that the run checks before it starts anything.
    from gagpo.learner.config import LearnerConfig

    actor_sets = parse_sets(by_table["actors"], ActorConfig)
    learner_sets = parse_sets(by_table["learner"], LearnerConfig)
    actor_cfg = load_table(
        ActorConfig, path, "actors", actor_sets | {"store": store}, by_table["actors"]
    )
    learner_cfg = load_table(
        LearnerConfig, path, "learner", learner_sets | {"store": store}, by_table["learner"]
    )
    check_store_path(store)
    from gagpo.envs import check_env

    check_env(actor_cfg.env, dict(actor_cfg.env_options))
    actor_args = [arg for item in by_table["actors"] for arg in ("--set", item)]
    learner_args = [arg for item in by_table["learner"] for arg in ("--set", item)]
    if config.eval_groups and not learner_cfg.keep_every:  # keep what will be evaluated
        learner_args += ["--set", f"keep_every={config.eval_every}"]
    warm_cfg = warmstart_config(path, actor_cfg) if warm else None
    from gagpo.storage.store import Store, new_id
    from gagpo.workflows.launch import launcher_for
    from gagpo.workflows.layout import plan_run

    run_id = new_id()
    launcher = launcher_for(ray, config, store, run_id, echo)

    def plan(policy_flags: list[str]):
        return plan_run(
            path,
            store,
            config,
            actor_cfg,
            learner_cfg,
            actor_args=policy_flags + actor_args,
            learner_args=policy_flags + learner_args,
            run_id=run_id,
        )

    if dry_run:
        warm_flags = []
        if warm_cfg is not None:  # where the warm start is (or would be) cached
            from gagpo.workflows.warmstart import POLICY_DIR, cache_key, warmstart_root

            warm_flags = ["--policy", str(warmstart_root() / cache_key(warm_cfg) / POLICY_DIR)]
        echo(launcher.describe(plan(warm_flags)))
        return 0
    launcher.check(plan([]))  # an impossible placement fails before the warm start is built
    Store(store).ensure_writable()
    # SIGTERM ends us like Ctrl-C. SIGINT is handled explicitly too: a shell starts background
    # jobs with SIGINT ignored, and the children would inherit that and ignore our SIGINT.
    previous = {
        signal.SIGTERM: signal.signal(signal.SIGTERM, _raise_interrupt),
        signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler),
    }
    try:
        policy_flags = []
        if warm_cfg is not None:
            policy_flags = ["--policy", str(warmstart(warm_cfg, echo=echo))]
        code = launcher.run(plan(policy_flags))
    except KeyboardInterrupt:
        echo("interrupted: every process started was stopped; committed shards are kept")
        return 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    from gagpo.learner.cli import EXIT_STOPPED_EARLY

    if code in (0, EXIT_STOPPED_EARLY):  # stopped early: the learner said why; show what ran
        echo(summary(store))
        echo(after_run(store, config, actor_cfg, learner_cfg.estimator, echo))
        echo(f"browse it (pip install 'gagpo[view]'): gagpo view --store {store}")
        for line in launcher.after():
            echo(line)
    return code


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


def summary(store: str) -> str:
    """Success rate, valid replies and return per policy version, from the store's SQL views."""
    from gagpo.inspection.sql import close_store_db, open_store_db
    from gagpo.storage.store import Store

    opened = Store(store)
    con = open_store_db(opened)
    try:
        return _summary(con, opened, store)
    finally:
        close_store_db(con)


def _summary(con, opened, store: str) -> str:
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
    lines.append(_group_use(con, opened))
    lines.append(f"store: {store}  (inspect with: gagpo sql --store {store})")
    return "\n".join(lines)


def after_run(store: str, config: RunConfig, actor_cfg: ActorConfig, estimator, echo) -> str:
    """What follows the run summary: the held-out evaluation, the report, the credit
    comparison (when the run's steps are of an environment with a step oracle), then the
    closing lines: held-out v0 → last with its interval, the credit table, where the report
    and the credit figure are."""
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


def credit_lines(store: str, estimator, echo) -> list[str]:
    """The credit comparison of the run's own steps, when their environment declares a step
    oracle (envs/base.py StepOracle); none otherwise."""
    from gagpo.workflows.credit import credit_report, oracle_env

    try:
        env = oracle_env(store)
        if env is None:
            return []
        echo("credit comparison: recomputing the run's steps under GRPO, GiGPO and GAGPO …")
        return credit_report(store, estimator, report_dir(store), env)[1]
    except GagpoError as exc:  # e.g. no shard committed: say so, the run itself is done
        return [f"credit comparison: skipped ({exc})"]


def report_dir(store: str) -> Path:
    """Where the run's report goes: STORE/report/, or ./gagpo-report for a remote store."""
    from gagpo.schemas import layout
    from gagpo.storage.store import Store

    return Path(layout.report_dir(store)) if Store(store).is_local else Path("gagpo-report")


def report(store: str) -> str:
    """Write `gagpo report` for the store; say where it and its learning curve are."""
    from gagpo.inspection.report import write_report

    out = report_dir(store)
    written = write_report(store, out)
    curve = next((f for f in written.figures if f.name == "learning_curves.png"), None)
    lines = [f"report: {written.summary}"]
    if curve is not None:
        lines.append(f"learning curve: {curve}")
    return "\n".join(lines)
