"""Unknown keys and tables in a TOML config, named with the closest known one.

A config model refuses an unknown key (`extra="forbid"`), but its message cannot say which
key was meant. `check_keys` walks a TOML table against its model before the model sees it,
nested tables included, and names the first unknown key with its closest known spelling
(`[warmstrat]`: did you mean [warmstart]?) or, when none is close, every accepted key.
"""

from __future__ import annotations

import difflib
from typing import Any

from gagpo.schemas.errors import GagpoError
from gagpo.schemas.overrides import nested_models


def closest(name: str, known: list[str]) -> str | None:
    """The known name `name` most likely misspells, or None when none is close."""
    found = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return found[0] if found else None


def unknown(name: str, known: list[str], what: str, shown=str) -> str:
    """'unknown WHAT NAME; did you mean X?' or '…; accepted: A, B, C'."""
    near = closest(name, known)
    if near is not None:
        return f"unknown {what} {shown(name)}; did you mean {shown(near)}?"
    return f"unknown {what} {shown(name)}; accepted: {', '.join(shown(k) for k in sorted(known))}"


def check_keys(table: dict[str, Any], model: Any, where: str, name: str = "") -> None:
    """A one-line GagpoError for the first key of `table` (nested tables included) that no
    field of `model` (a config model, or a union of them) names. `where` names the file
    ("recipe 'r.toml'"), `name` the table ("learner"; a nested one is "learner.loss")."""
    models = nested_models(model)
    if not models or any(m.model_config.get("extra") == "allow" for m in models):
        return  # a free-form table, or a model that takes keys of its own choosing
    fields = {field: info for m in models for field, info in m.model_fields.items()}
    for key, value in table.items():
        if key not in fields:
            at = f"{where} [{name}]" if name else where
            raise GagpoError(f"{at}: {unknown(key, list(fields), 'key', repr)}")
        if isinstance(value, dict):
            check_keys(value, fields[key].annotation, where, f"{name}.{key}" if name else key)
