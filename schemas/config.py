"""The configuration base every config model shares, and its loading: TOML and flags.

The models live beside their layer: `ActorConfig` in actors/config.py, `LearnerConfig` in
learner/config.py, a `gagpo run` recipe in workflows/recipe.py.

Every field has bounds and a docstring (shown by `--help`). `load_config` turns a
pydantic error into one line naming the field and what is accepted.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict
from pydantic import ValidationError as PydanticValidationError

from gagpo.schemas import bounded_toml
from gagpo.schemas.errors import GagpoError
from gagpo.schemas.overrides import set_dotted

RUN_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"

# The share of its GPU's memory a process started by `gagpo run` may take (workflows/layout.py);
# the learner and transformers actors cap their CUDA allocator with it.
GPU_MEMORY_SHARE_ENV = "GAGPO_GPU_MEMORY_SHARE"


def gpu_memory_share() -> float | None:
    """This process's share of its GPU's memory ($GAGPO_GPU_MEMORY_SHARE), None when unset."""
    import os

    raw = os.environ.get(GPU_MEMORY_SHARE_ENV)
    if not raw:
        return None
    try:
        share = float(raw)
    except ValueError:
        share = -1.0
    if not 0.0 < share <= 1.0:
        raise GagpoError(f"{GPU_MEMORY_SHARE_ENV}={raw!r}; accepted: a number in (0, 1]")
    return share


class Config(BaseModel):
    """Base: unknown keys are errors, docstrings become field descriptions, and values are
    taken as typed: `groups_in_flight = "4"` or `actors = true` in a recipe is refused, not
    read as 4 or 1 (strict; an int still fills a float field)."""

    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, validate_assignment=True, strict=True
    )


M = TypeVar("M", bound=BaseModel)


def describe_error(error: PydanticValidationError, prefix: str = "", errors=None) -> str:
    """One line for the first problem (of `errors`, default all): field path, what is
    wrong, and the value given."""
    return describe_problem((errors or error.errors())[0], prefix)


def describe_problem(problem: dict[str, Any], prefix: str = "") -> str:
    """One line for one of pydantic's problems (an item of `ValidationError.errors()`)."""
    field = ".".join(str(p) for p in problem["loc"]) or "(config)"
    if problem["type"] == "extra_forbidden":
        return f"{prefix}unknown config field '{field}'"
    return f"{prefix}config field '{field}': {problem['msg']} (got {problem.get('input')!r})"


def read_toml(path: str | Path, section: str | None = None) -> dict[str, Any]:
    """Read a TOML file, within the bounds of schemas/bounded_toml.py (a regular file of at
    most 1 MiB, nested at most 32 deep); with `section`, that table (or the whole file if it
    has none)."""
    path = Path(path)
    what = f"config file {str(path)!r}"
    try:
        data = bounded_toml.loads(bounded_toml.read_text(path, what), what)
    except FileNotFoundError:
        raise GagpoError(f"{what} does not exist; accepted: a TOML file") from None
    except OSError as exc:  # permissions, a path through a file, ...
        raise GagpoError(
            f"{what} cannot be read ({exc.strerror or exc}); accepted: a readable TOML file"
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise GagpoError(f"{what} is not valid TOML: {exc}") from None
    if section and isinstance(data.get(section), dict):
        return data[section]
    return data


def _check_file(model: type[BaseModel], data: dict[str, Any]) -> None:
    """A wrong value in the file is reported even where a flag or --set overrides it (a
    config file is checked as written): every problem but a field it leaves to the flags."""
    try:
        model.model_validate(data)
    except PydanticValidationError as exc:
        wrong = [e for e in exc.errors() if e["type"] not in ("missing", "extra_forbidden")]
        if wrong:
            raise GagpoError(describe_error(exc, errors=wrong)) from None


def load_config(
    model: type[M],
    path: str | Path | None = None,
    *,
    section: str | None = None,
    overrides: dict[str, Any] | None = None,
) -> M:
    """Build a config model from an optional TOML file plus CLI overrides (None = not given)."""
    data: dict[str, Any] = read_toml(path, section) if path else {}
    if data:
        _check_file(model, data)
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        set_dotted(data, key, value)  # nested overrides such as "sampling.temperature"
    try:
        return model.model_validate(data)
    except PydanticValidationError as exc:
        if any(error["type"] == "extra_forbidden" for error in exc.errors()):
            from gagpo.schemas.suggest import check_keys  # a misspelt key: name the closest

            where = f"config file {str(path)!r}" if path else "the settings"
            check_keys(data, model, where, section or "")
        raise GagpoError(describe_error(exc)) from None
