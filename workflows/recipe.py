"""A `gagpo run` recipe as one model: the [run], [actors], [learner] and [warmstart] tables.

`load_recipe` reads the TOML file once, applies `--actors` and the `--set` items, gives
both sides the run's store and validates the whole. Each table is its layer's model
(`RunConfig` here, `ActorConfig`, `LearnerConfig`, `WarmstartConfig`); every problem is one
line naming the recipe and the table (`with --set` when that table was overridden). The
rules that span tables are `Recipe`'s own:

- one store: the actors write where the learner reads (`gagpo run --store`); a table of
  the file that names another store is refused, and so is `--set actors.store=…`;
- one policy: the learner trains the policy the actors play, so a [learner] policy other
  than the [actors] one (a default included) is refused;
- nothing said that the run does not do: the settings `gagpo run` gives each process
  itself (`RUN_OWNED`: the store, the actors' run id, `follow`, `groups`) are refused in a
  `--set`, and in the file where they would be overridden unseen; so is device = "cpu"
  for a process the run places on GPUs;
- the warm start inherits what shapes the prompts (environment and its options, policy,
  turn limit, history window, prompt budget) from the [actors] table as overridden, unless
  its own table sets them, so demonstrations are tokenized as the RL actors present prompts.

Light to import (pydantic, no torch): `gagpo run --dry-run` checks a recipe before any
heavy import.
"""

from __future__ import annotations

from collections.abc import Iterable
from importlib import resources
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic import ValidationError as PydanticValidationError

from gagpo.actors.config import ActorConfig
from gagpo.learner.config import LearnerConfig
from gagpo.schemas.config import Config, describe_problem, read_toml
from gagpo.schemas.errors import GagpoError
from gagpo.schemas.overrides import parse_sets, set_dotted, split_sections
from gagpo.schemas.suggest import check_keys, unknown
from gagpo.workflows.recipes import shipped as shipped_recipes
from gagpo.workflows.warmstart import WarmstartConfig


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


TABLES: dict[str, type[Config]] = {
    "run": RunConfig,
    "actors": ActorConfig,
    "learner": LearnerConfig,
    "warmstart": WarmstartConfig,
}
REQUIRED_TABLES = ("run", "actors", "learner")  # and optionally [warmstart]
SET_TABLES = REQUIRED_TABLES  # the tables `--set TABLE.KEY=VALUE` reaches
SHARED_STORE = ("actors", "learner")  # the tables that get the run's store
_STORE = "gagpo run --store gives the actors and the learner their store"
# (table, key) -> why the run does not use a value of it: it gives the processes their own.
RUN_OWNED: dict[tuple[str, str], str] = {
    ("actors", "store"): _STORE,
    ("learner", "store"): _STORE,
    ("actors", "run_id"): "gagpo run names its actors' run itself (a new id per run)",
    ("actors", "follow"): "gagpo run's actors always follow the learner's versions",
    ("actors", "groups"): "gagpo run's actors play until the learner has made [learner] "
    "updates (set those instead)",
}


def prompt_shape(actors: ActorConfig) -> dict[str, Any]:
    """What shapes the actors' prompts: the settings a warm start inherits from [actors].
    A prompt budget the actors leave to the model (unset: its context less the reply) is
    not inherited: the warm start keeps its own (WarmstartConfig.max_prompt_tokens)."""
    shape = {
        "env": actors.env,
        "env_options": actors.env_options,
        "policy": actors.policy,
        "max_turns": actors.max_turns,
        "history_window": actors.history_window,
        "max_prompt_tokens": actors.sampling.max_prompt_tokens,
    }
    return {key: value for key, value in shape.items() if value is not None}


class Recipe(Config):
    """A `gagpo run` recipe: its tables, and the rules between them."""

    run: RunConfig
    """[run]: the processes, their GPUs, and what follows the run."""
    actors: ActorConfig
    """[actors]: every actor process's settings (each with its own task seeds)."""
    learner: LearnerConfig
    """[learner]: the learner's settings."""
    warmstart: WarmstartConfig | None = None
    """[warmstart]: demonstrations and supervised fine-tuning of the base policy, run (or
    taken from the cache) before the actors and the learner start; none: the base policy."""

    @field_validator("warmstart", mode="before")
    @classmethod
    def _inherit_from_actors(cls, table: object, info: ValidationInfo) -> object:
        # [actors] is validated first (field order); a table given as a model is taken as is.
        actors = info.data.get("actors")
        if not isinstance(table, dict) or actors is None:
            return table
        return {**prompt_shape(actors), **table}

    @model_validator(mode="after")
    def _one_policy(self) -> Recipe:
        # The learner starts from the version 0 the actors publish: another base policy
        # would be logged as trained while the actors' weights are.
        if self.learner.policy != self.actors.policy:
            unset = "" if "policy" in self.learner.model_fields_set else " (the default)"
            raise GagpoError(
                f"the actors play policy {self.actors.policy!r} but the learner's is "
                f"{self.learner.policy!r}{unset}; accepted: the same policy in [actors] and "
                "[learner] (a warm start then replaces both)"
            )
        return self

    @model_validator(mode="after")
    def _gpus_not_cpu(self) -> Recipe:
        # A process given GPUs is started on CUDA (workflows/layout.py): a table that says
        # cpu would be overridden unseen.
        for table, field in (("actors", "actor_gpus"), ("learner", "learner_gpus")):
            gpus = getattr(self.run, field)
            if gpus and getattr(self, table).device == "cpu":
                raise GagpoError(
                    f"run.{field} = {gpus} but {table}.device = 'cpu'; accepted: device = "
                    f"'cuda' or 'auto' with run.{field}, or no run.{field}"
                )
        return self

    @model_validator(mode="after")
    def _one_store(self) -> Recipe:
        # A GagpoError, not a ValueError: pydantic passes it through as the one line itself.
        if self.actors.store != self.learner.store:
            raise GagpoError(
                f"the actors write into {self.actors.store!r} but the learner reads "
                f"{self.learner.store!r}; accepted: one store for both (gagpo run --store)"
            )
        return self


def shipped() -> str:
    return ", ".join(shipped_recipes())


def recipe_path(recipe: str | Path) -> Path:
    """A recipe file path, or the name of a recipe shipped in workflows/recipes/."""
    path = Path(recipe)
    if path.suffix == ".toml" or path.exists():
        if not path.is_file():
            what = "is not a regular file" if path.exists() else "does not exist"
            raise GagpoError(
                f"recipe {str(recipe)!r} {what}; accepted: a TOML file or one of {shipped()}"
            )
        return path
    shipped_file = resources.files("gagpo.workflows") / "recipes" / f"{recipe}.toml"
    if not shipped_file.is_file():
        raise GagpoError(f"unknown recipe {recipe!r}; accepted: a TOML file or one of {shipped()}")
    return Path(str(shipped_file))


def load_recipe(
    recipe: str | Path, store: str, *, sets: Iterable[str] = (), actors: int | None = None
) -> Recipe:
    """The recipe (a file or a shipped name) read once, with `--actors` and the `--set`
    items TABLE.KEY=VALUE over it and `store` given to both sides; GagpoError (one line)
    for anything wrong, before anything starts."""
    path = recipe_path(recipe)
    where = f"recipe {str(path)!r}"
    data = read_toml(path)
    check_tables(data, where)
    check_run_owned(data, where)
    check_as_written(data, where)
    by_table = split_sections(sets, SET_TABLES)
    overrides = {table: parse_sets(items, TABLES[table]) for table, items in by_table.items()}
    for table, values in overrides.items():
        for key in values:
            if (table, key) in RUN_OWNED:
                raise GagpoError(
                    f"--set {table}.{key}: gagpo run does not use it ({RUN_OWNED[table, key]}); "
                    f"accepted: --set of any other key of [{table}]"
                )
    if actors is not None:
        overrides["run"]["actors"] = actors  # the flag over a --set run.actors
    for table in SHARED_STORE:
        overrides[table]["store"] = _shared_store(data[table], store, f"{where} [{table}]")
    for table, values in overrides.items():
        for key, value in values.items():
            set_dotted(data[table], key, value)
    overridden = {table for table, items in by_table.items() if items}
    try:
        return _validate(data, where)
    except PydanticValidationError as exc:
        raise GagpoError(_one_line(exc.errors(), where, overridden)) from None


def check_tables(data: dict[str, Any], where: str) -> None:
    """The recipe's tables before any is validated: each one known ([warmstrat] is refused,
    naming [warmstart], rather than left out of the run), the required ones present, and
    every key of every table a field of its model (a misspelt key names the closest one)."""
    for name, table in data.items():
        if name not in TABLES:
            raise GagpoError(f"{where}: {unknown(name, list(TABLES), 'table', _table)}")
        if not isinstance(table, dict):
            raise GagpoError(f"{where}: '{name}' must be a table ([{name}]), not {table!r}")
        check_keys(table, TABLES[name], where, name)
    missing = [name for name in REQUIRED_TABLES if name not in data]
    if missing:
        raise GagpoError(
            f"{where} has no {_table(missing[0])} table; accepted: a recipe with the tables "
            "[run], [actors] and [learner] (and optionally [warmstart]), as the shipped ones "
            f"({shipped()})"
        )


def check_run_owned(data: dict[str, Any], where: str) -> None:
    """A setting of the file that `gagpo run` would override unseen (`RUN_OWNED`): the
    actors' run id or groups, or follow = false; a store is checked against the run's
    (`_shared_store`)."""
    actors = data["actors"]
    for key in ("run_id", "groups"):
        if key in actors:
            raise GagpoError(
                f"{where} [actors]: {key} = {actors[key]!r}, which gagpo run does not use "
                f"({RUN_OWNED['actors', key]}); accepted: no {key} in a recipe"
            )
    if actors.get("follow", True) is not True:
        raise GagpoError(
            f"{where} [actors]: follow = {actors['follow']!r}, but {RUN_OWNED['actors', 'follow']}; "
            "accepted: no follow in a recipe"
        )


def check_as_written(data: dict[str, Any], where: str) -> None:
    """A wrong value in the file is refused even where a flag or --set overrides it (a
    recipe is checked as written): every problem but the store the run gives."""
    try:
        _validate(data, where)
    except PydanticValidationError as exc:
        wrong = [e for e in exc.errors() if e["type"] not in ("missing", "extra_forbidden")]
        if wrong:
            raise GagpoError(_one_line(wrong, where, set())) from None


def _validate(data: dict[str, Any], where: str) -> Recipe:
    """`Recipe` of `data`; a rule between tables (a GagpoError) names the recipe. Pydantic's
    problems are raised as they are, for the caller to choose which to report."""
    try:
        return Recipe.model_validate(data)
    except GagpoError as exc:
        raise GagpoError(f"{where}: {exc}") from None


def _shared_store(table: dict[str, Any], store: str, where: str) -> str:
    """The run's store for a table of the file, which may name only that one."""
    named = table.get("store", store)
    if named != store:
        raise GagpoError(
            f"{where}: store = {named!r}, but the run's store is {store!r}; accepted: no "
            "store in the recipe (gagpo run --store gives the actors and the learner theirs)"
        )
    return store


def _one_line(problems: list[dict[str, Any]], where: str, overridden: set[str]) -> str:
    """The first problem, with the table it is in: "recipe 'r.toml' [run] with --set: …"."""
    table, *field = problems[0]["loc"]
    given = " with --set" if table in overridden else ""
    return describe_problem({**problems[0], "loc": tuple(field)}, f"{where} [{table}]{given}: ")


def _table(name: str) -> str:
    return f"[{name}]"
