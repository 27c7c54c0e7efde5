"""Dotted overrides from the command line: `--set loss.eps_low=0.1` reaches any nested field.

A `--set` item is `KEY=VALUE`. KEY is a dotted path into the command's config model
(`loss.eps_low`, `lora.rank`, `sampling.top_p`, `estimator.lam`); the command's TOML table
name may lead it (`learner.loss.eps_low` on gagpo-learner). VALUE is read as a TOML value
(`0.1`, `true`, `["q_proj", "v_proj"]`, `"text"`); anything that is not one stays a string
(`env_options.challenge=tw-cooking`). The path is checked against the model before the
model validates the value, so a typo names the field and the accepted names.
"""

from __future__ import annotations

import tomllib
import types
import typing
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel

from gagpo.schemas import bounded_toml
from gagpo.schemas.errors import GagpoError


def set_help(*examples: str, tables: tuple[str, ...] = (), over: str = "--config") -> str:
    """--help text of a `--set` option, with examples of the command's own keys."""
    table = (
        f"TABLE.KEY=VALUE with TABLE one of {', '.join(tables)} and" if tables else "KEY=VALUE with"
    )
    return (
        f"Set any nested setting: {table} a dotted KEY (e.g. {', '.join(examples)}); "
        "VALUE is read as TOML (numbers, true/false, [lists]), else as text. Repeatable; "
        f"applied over {over}, under explicit flags; checked before anything starts."
    )


def parse_value(raw: str, what: str = "a value") -> Any:
    """A TOML value (`0.1`, `true`, `[1, 2]`, `"x"`), else the text itself; one GagpoError
    line, opened by `what` (`--set KEY`), for a value nested deeper than
    schemas/bounded_toml.py allows."""
    try:
        return bounded_toml.loads(f"v = {raw}", what)["v"]
    except tomllib.TOMLDecodeError:
        return raw


def nested_models(annotation: Any) -> list[type[BaseModel]] | None:
    """The config models a field holds (several for a union such as the estimator), or
    None for a free-form table (dict, Any); [] for a plain value."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return nested_models(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        found = [nested_models(arg) for arg in typing.get_args(annotation) if arg is not type(None)]
        if any(f is None for f in found):
            return None
        return [m for f in found for m in f]
    if origin is dict or annotation is dict or annotation is Any:
        return None
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return []


def check_path(model: Any, key: str) -> None:
    """Raise a one-line GagpoError unless `key` names a field of `model` (a config model, or a
    union of them such as the estimator configs), nested by dots."""
    models = nested_models(model)
    walked: list[str] = []
    for part in key.split("."):
        if models is None:  # inside a free-form table: any key
            return
        if not models:
            raise GagpoError(
                f"--set {key}: '{'.'.join(walked)}' is a value, not a table; accepted: "
                f"--set {'.'.join(walked)}=VALUE"
            )
        fields = {name: info for m in models for name, info in m.model_fields.items()}
        if part not in fields:
            where = f"'{'.'.join(walked)}'" if walked else "the settings"
            raise GagpoError(
                f"--set {key}: unknown field '{part}' in {where}; accepted: "
                f"{', '.join(sorted(fields))}"
            )
        walked.append(part)
        models = nested_models(fields[part].annotation)


def parse_sets(items: Iterable[str], model: Any, section: str | None = None) -> dict[str, Any]:
    """`--set` items → {dotted key: value}, each key checked against `model`. A leading
    `section.` (the model's TOML table) is dropped."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not p for p in key.split(".")):
            raise GagpoError(
                f"--set {item!r} is not KEY=VALUE; accepted: a dotted key, '=', a value "
                "(e.g. --set loss.eps_low=0.1)"
            )
        if section and key.startswith(f"{section}."):
            key = key.split(".", 1)[1]
        check_path(model, key)
        out[key] = parse_value(raw.strip(), f"--set {key}")
    return out


def split_sections(items: Iterable[str], sections: Iterable[str]) -> dict[str, list[str]]:
    """`--set` items of a multi-table command (gagpo run) by their leading table name."""
    sections = list(sections)
    out: dict[str, list[str]] = {s: [] for s in sections}
    for item in items:
        head = item.split("=", 1)[0].split(".", 1)
        if head[0] not in out or len(head) < 2:
            raise GagpoError(
                f"--set {item!r}: the key must start with a recipe table; accepted: "
                f"{', '.join(f'{s}.KEY=VALUE' for s in sections)}"
            )
        out[head[0]].append(item.split(".", 1)[1])
    return out


def merge(sets: dict[str, Any], flags: dict[str, Any]) -> dict[str, Any]:
    """Overrides for `load_config`: the `--set` values, then the flags that were given."""
    return {**sets, **{k: v for k, v in flags.items() if v is not None}}


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    """data["a"]["b"]["c"] = value for key "a.b.c", creating tables on the way."""
    *outer, last = key.split(".")
    for part in outer:
        inner = data.get(part)
        if not isinstance(inner, dict):
            inner = data[part] = {}
        data = inner
    data[last] = value
