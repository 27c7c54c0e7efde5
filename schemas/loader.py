"""User code named on the command line or in a config as `module:function` (the Gym
adapter's `state_key`, state grouping's `normalized:MODULE:FUNCTION`).

Every way it can fail is one GagpoError line: a spec without both parts, a module or
attribute that is missing, a module that fails to import (a syntax error, an exception,
`sys.exit` at import time), an attribute that is not callable.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from gagpo.schemas.errors import GagpoError, describe


def load_object(spec: str, what: str, accepted: str = "module:function") -> Callable[..., Any]:
    """The callable `spec` ("module:function") names. `what` opens each error line (e.g.
    "state_key function 'mod:f'") and `accepted` ends it."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise GagpoError(f"{what} is not module:function; accepted: {accepted}")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise GagpoError(
            f"{what} cannot be loaded: cannot load {name!r} from module {module!r} "
            f"({describe(exc)}); accepted: {accepted}"
        ) from None
    except (Exception, SystemExit) as exc:  # the user's module itself is broken
        raise GagpoError(
            f"{what}: module {module!r} fails to import ({describe(exc)}); accepted: a module "
            "that imports"
        ) from None
    if not callable(fn):
        raise GagpoError(f"{what} is not callable ({type(fn).__name__}); accepted: {accepted}")
    return fn
