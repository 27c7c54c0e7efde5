"""The types of an environment's options, checked before it is built.

`--env-options "{sizes = 'x'}"` on sokoban used to reach its constructor and end in a
TypeError traceback from inside the game (`'<=' not supported between 'int' and 'str'`).
An environment's constructor already says what each option is (`sizes: tuple[int, int]`),
so each option given is checked against that annotation (pydantic, lax: a TOML list fills
a tuple, an int a float) and a wrong one is one line naming the option, the value and the
type accepted. The value passed on is the user's own, unconverted. An annotation that
cannot be resolved or checked (a name imported only for type checkers, a class pydantic
has no schema for) is left to the constructor.
"""

from __future__ import annotations

import inspect
import typing
from typing import Any

from gagpo.schemas.errors import GagpoError


def check_option_types(name: str, init: Any, options: dict[str, Any]) -> None:
    """A GagpoError for the first option of `options` whose value is not of the type the
    constructor `init` annotates its parameter with."""
    try:
        hints = typing.get_type_hints(init)
    except Exception:  # unresolvable annotations: the constructor checks
        return
    for option, value in options.items():
        annotation = hints.get(option)
        if annotation is None or annotation is Any:
            continue
        problem = _problem(annotation, value)
        if problem is not None:
            raise GagpoError(
                f"environment {name!r} option {option!r}: {problem} (got {value!r}); "
                f"accepted: {_shown(annotation)}"
            )


def _problem(annotation: Any, value: Any) -> str | None:
    """Pydantic's first complaint about `value` as `annotation`, or None when it is one
    (or the annotation cannot be checked)."""
    from pydantic import TypeAdapter, ValidationError

    try:
        adapter = TypeAdapter(annotation)
    except Exception:  # no schema for this annotation: the constructor checks
        return None
    try:
        adapter.validate_python(value)
    except ValidationError as exc:
        return exc.errors()[0]["msg"]
    except Exception:  # a validator of the user's type failed otherwise
        return None
    return None


def _shown(annotation: Any) -> str:
    """An annotation as it is written (`tuple[int, int]`, `str | None`)."""
    return inspect.formatannotation(annotation)
