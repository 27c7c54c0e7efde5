"""Command-line options generated from the config models, so that a setting is defined once:
as a field with its type, bounds and docstring. Its flag, help, choices and bounds follow.

Names. A field is `--` and its name with dashes (`group_size`: `--group-size`). The fields
of a nested model are flattened under the table's name (`sampling.top_p`:
`--sampling-top-p`, `loss.eps_low`: `--loss-eps-low`); a union of models (the estimator
configs) offers every field that one of its variants has, the help naming the variants that
take it, and its discriminator, named like its table, is the table's flag
(`estimator.estimator`: `--estimator`). A CLI adds a short table of aliases, more names for
the same option, where its users know another one (`--top-p` for `sampling.top_p`).

Kinds. A `Literal` is a choice; a bool is `--x/--no-x`; a list is repeatable and also takes
comma-separated items or a TOML list (`[...]`); a free-form table (dict) takes a TOML inline
table (`{challenge = "tw-cooking"}`); anything else one value of the field's type.

Layering. Every option defaults to None, "not given": `given` returns only what was typed,
by dotted key, and `load` lays that over `--set`, over the `--config` TOML, over the
defaults (schemas.overrides.merge, schemas.config.load_config). A flag's text is converted to
the field's type here (one line naming the field when it is not one); bounds and choices are
the model's to check, so a bad flag gets the same line as the same value in a TOML file.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import annotated_types
import click
from pydantic import BaseModel, TypeAdapter
from pydantic import ValidationError as PydanticValidationError
from pydantic.fields import FieldInfo

from gagpo.schemas.errors import GagpoError
from gagpo.schemas.overrides import merge, nested_models, parse_sets, parse_value

_METAVARS = {int: "INTEGER", float: "FLOAT", str: "TEXT"}


def _bare(annotation: Any) -> Any:
    """The annotation without `| None`."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _literals(annotation: Any) -> tuple[Any, ...]:
    """The values of a `Literal[...]` annotation; () for any other."""
    annotation = _bare(annotation)
    return typing.get_args(annotation) if typing.get_origin(annotation) is typing.Literal else ()


def _text(value: Any) -> str:
    """A value as a user types it on the command line: true/false, comma-separated items."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list | tuple):
        return ",".join(_text(v) for v in value)
    return str(value)


def _default(info: FieldInfo) -> str | None:
    """A field's default as text; None when it has none worth showing (None, empty)."""
    if info.is_required():
        return None
    value = info.default_factory() if info.default_factory else info.default  # type: ignore[call-arg]
    return None if value is None or value in ([], {}) else _text(value)


def _number(value: float) -> str:
    """A bound as one reads it: 0.5, 1e+06, 2^62."""
    if isinstance(value, int) and value >= 2**20 and value & (value - 1) == 0:
        return f"2^{value.bit_length() - 1}"
    return f"{value:g}" if isinstance(value, float) or value >= 10**6 else str(value)


def _bounds(info: FieldInfo) -> str | None:
    """`0<=x<1`-style bounds of a numeric field, as click shows those of an IntRange."""
    lower = upper = ""
    for item in info.metadata:
        if isinstance(item, annotated_types.Gt):
            lower = f"{_number(item.gt)}<"
        elif isinstance(item, annotated_types.Ge):
            lower = f"{_number(item.ge)}<="
        elif isinstance(item, annotated_types.Lt):
            upper = f"<{_number(item.lt)}"
        elif isinstance(item, annotated_types.Le):
            upper = f"<={_number(item.le)}"
    return f"{lower}x{upper}" if lower or upper else None


@dataclass(frozen=True)
class Setting:
    """One leaf field of a config model, reached by its dotted `key`. Inside a union,
    `infos` holds the field as each variant that has it declares it, `names` those
    variants' names and `partial` whether some variant lacks it."""

    key: str
    infos: tuple[FieldInfo, ...]
    names: tuple[str, ...] = ()
    partial: bool = False
    discriminator: tuple[str, ...] = ()  # the union's variant names, on its discriminator
    tag: str = ""  # the name of the union's discriminator (estimator)
    whole: bool = False  # list items are never split at commas (paths, globs)

    @property
    def annotation(self) -> Any:
        return _bare(self.infos[0].annotation)

    @property
    def kind(self) -> str:
        """bool, list, table (a free-form dict) or value."""
        origin = typing.get_origin(self.annotation) or self.annotation
        if self.annotation is bool:
            return "bool"
        if origin in (list, tuple, set, frozenset):
            return "list"
        if origin is dict:
            return "table"
        return "value"

    @property
    def choices(self) -> tuple[str, ...]:
        return self.discriminator or tuple(str(v) for v in _literals(self.annotation))

    @property
    def flag(self) -> str:
        """`--` and the dotted key with dashes; a discriminator named like its table
        (estimator.estimator) is the table's flag."""
        parts = self.key.split(".")
        if len(parts) > 1 and parts[-1] == parts[-2]:
            parts.pop()
        return "--" + "-".join(parts).replace("_", "-")

    @property
    def param(self) -> str:
        """The click parameter name: a Python identifier."""
        return self.key.replace(".", "__")

    @property
    def description(self) -> str:
        return " ".join((self.infos[0].description or "").split())

    def metavar(self) -> str | None:
        if self.kind == "list":
            item = (typing.get_args(self.annotation) or (str,))[0]
            if typing.get_origin(item) is typing.Annotated:  # bounded items (adam_betas)
                item = typing.get_args(item)[0]
            values = _literals(item)
            name = "|".join(map(str, values)) if values else _METAVARS.get(item, "TEXT")
            return f"{name}[,...]"
        if self.kind == "table":
            return "TABLE"
        return None if self.choices else _METAVARS.get(self.annotation, "TEXT")

    def help(self, extra: str = "") -> str:
        """The docstring, the variants that take the field, `extra`, how a list or a table
        is typed, then the default and the bounds."""
        text = self.description
        if self.partial:
            *most, last = self.names
            text += f" Only with {self.tag} {', '.join(most) + ' or ' if most else ''}{last}."
        if extra:
            text += f" {extra}"
        if self.kind == "list":
            text += (
                " Repeatable." if self.whole else " Repeatable; items may also be comma-separated."
            )
        elif self.kind == "table":
            text += " A TOML inline table."
        notes = [note for note in (self._default(), _bounds(self.infos[0])) if note]
        return f"{text} [{'; '.join(notes)}]" if notes else text

    def _default(self) -> str | None:
        if self.infos[0].is_required():
            return "required"
        first = _default(self.infos[0])
        if first is None:
            return None
        if self.discriminator:  # each variant's own name: the first is the default
            return f"default: {first}"
        others = [
            f"{name}: {text}"
            for name, info in zip(self.names[1:], self.infos[1:], strict=True)
            if (text := _default(info)) != first
        ]
        return "; ".join([f"default: {first}", *others])

    def convert(self, raw: Any) -> Any:
        """What the user typed (a tuple of texts for a list) as the field's type; a
        GagpoError naming the field when it is not one."""
        if self.kind == "bool" or self.discriminator:  # the model names a wrong estimator
            return raw
        value: Any = raw
        if self.kind == "list":
            value = []
            for item in raw:
                parsed = (
                    parse_value(item, f"config field '{self.key}'")
                    if item.strip().startswith("[")
                    else None
                )
                if isinstance(parsed, list):
                    value += parsed
                elif self.whole:
                    value.append(item)
                else:
                    value += [part.strip() for part in item.split(",") if part.strip()]
        elif self.kind == "table":
            value = parse_value(raw, f"config field '{self.key}'")
            if not isinstance(value, dict):
                raise GagpoError(
                    f"config field '{self.key}': not a TOML inline table (got {raw!r}); "
                    'accepted: e.g. {key = "value"}'
                )
        try:
            return TypeAdapter(self.annotation).validate_python(value)
        except PydanticValidationError as exc:
            shown = list(raw) if isinstance(raw, tuple) else raw
            raise GagpoError(
                f"config field '{self.key}': {exc.errors()[0]['msg']} (got {shown!r})"
            ) from None


def _discriminator(models: list[type[BaseModel]]) -> str | None:
    """The field whose single Literal value tells the variants of a union apart."""
    if len(models) < 2:
        return None
    for name in models[0].model_fields:
        values = [
            _literals(m.model_fields[name].annotation) if name in m.model_fields else ()
            for m in models
        ]
        if all(len(v) == 1 for v in values) and len({v[0] for v in values}) == len(models):
            return name
    return None


def settings(model: Any, prefix: str = "") -> Iterator[Setting]:
    """Every leaf field of a config model (or a union of them), nested models flattened,
    in declaration order."""
    models = nested_models(model) or []
    tag = _discriminator(models)
    names = [str(_literals(m.model_fields[tag].annotation)[0]) if tag else "" for m in models]
    found: dict[str, list[tuple[str, FieldInfo]]] = {}
    for name, variant in zip(names, models, strict=True):
        for field, info in variant.model_fields.items():
            found.setdefault(field, []).append((name, info))
    if tag:  # the discriminator first: it says which of the fields below apply
        found = {tag: found.pop(tag), **found}
    for field, declared in found.items():
        key = prefix + field
        if nested_models(declared[0][1].annotation):
            yield from settings(declared[0][1].annotation, f"{key}.")
            continue
        yield Setting(
            key=key,
            infos=tuple(info for _, info in declared),
            names=tuple(name for name, _ in declared) if tag else (),
            partial=bool(tag) and len(declared) < len(models),
            discriminator=tuple(names) if field == tag else (),
            tag=tag or "",
        )


class _Choice(click.Choice):
    """Lists a field's choices in --help and for completion. The value is checked later,
    against the field's type (`Setting.convert`) or, for a discriminator, by the model, so a
    wrong one gets the line a TOML file would, not click's usage block."""

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        return value


class ModelOptions:
    """The click options of one command's config model(s) (`roots`: the model, or for
    `gagpo advantages` its command model and the estimator union, keys at the top level).

    `aliases` maps more flag names to dotted keys (`{"--top-p": "sampling.top_p"}`);
    `extra_help` adds a sentence to a key's help; `metavars` names a key's value in --help;
    `skip` leaves keys to an option the command writes itself; `whole` names list keys whose
    items are never split at commas (paths, globs).
    """

    def __init__(
        self,
        *roots: Any,
        aliases: Mapping[str, str] | None = None,
        extra_help: Mapping[str, str] | None = None,
        metavars: Mapping[str, str] | None = None,
        skip: tuple[str, ...] = (),
        whole: tuple[str, ...] = (),
    ) -> None:
        self.roots = roots
        self.settings: dict[str, Setting] = {}
        for root in roots:
            for setting in settings(root):
                if setting.key not in skip:
                    self.settings[setting.key] = replace(setting, whole=setting.key in whole)
        self.aliases = dict(aliases or {})
        self.extra_help = dict(extra_help or {})
        self.metavars = dict(metavars or {})
        self.skip = skip
        unknown = [
            k
            for k in [*self.aliases.values(), *self.extra_help, *self.metavars, *whole]
            if k not in self.settings
        ]
        flags = [s.flag for s in self.settings.values()] + list(self.aliases)
        if unknown or len(set(flags)) != len(flags):
            raise ValueError(f"unknown keys {unknown} or flags named twice in {sorted(flags)}")

    @property
    def set_model(self) -> Any:
        """What a `--set` key is checked against: the root, or the union of the roots."""
        return self.roots[0] if len(self.roots) == 1 else typing.Union[self.roots]  # noqa: UP007

    def flags(self, key: str) -> list[str]:
        """The flag names of a key: its own, then its aliases."""
        return [self.settings[key].flag, *(a for a, k in self.aliases.items() if k == key)]

    def option(self, setting: Setting) -> Callable:
        names = self.flags(setting.key)
        attrs: dict[str, Any] = {
            "default": None,
            "help": setting.help(self.extra_help.get(setting.key, "")),
            "metavar": self.metavars.get(setting.key, setting.metavar()),
        }
        if setting.kind == "bool":
            names = [f"{name}/--no-{name[2:]}" for name in names]
            attrs.pop("metavar")
        elif setting.kind == "list":
            attrs["multiple"] = True
        if setting.choices and setting.kind == "value":
            attrs["type"] = _Choice(setting.choices)
            if setting.key not in self.metavars:
                attrs.pop("metavar")
        return click.option(*names, setting.param, **attrs)

    def __call__(self, command: Callable) -> Callable:
        """Decorate a click command function with every option, in the model's order."""
        for setting in reversed(self.settings.values()):
            command = self.option(setting)(command)
        return command

    def given(self, values: dict[str, Any]) -> dict[str, Any]:
        """{dotted key: typed value} of the options the user gave, taken out of `values`
        (the command's keyword arguments)."""
        out = {}
        for key, setting in self.settings.items():
            raw = values.pop(setting.param, None)
            if raw is not None and raw != ():
                out[key] = setting.convert(raw)
        return out

    def load(
        self,
        config_file: str | None,
        sets: tuple[str, ...],
        values: dict[str, Any],
        *,
        section: str,
    ) -> Any:
        """The command's config: its TOML table (`--config`), then `--set`, then the flags
        given, validated by the first root model."""
        from gagpo.schemas.config import load_config

        overrides = merge(parse_sets(sets, self.set_model, section), self.given(values))
        return load_config(self.roots[0], config_file, section=section, overrides=overrides)
