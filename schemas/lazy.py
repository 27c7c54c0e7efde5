"""A package's public names re-exported from the modules that define them, each module
imported only when one of its names is first used (PEP 562: a module `__getattr__`).

    __all__, __getattr__, __dir__ = lazy_exports(__name__, {"make_env": "gagpo.envs.registry"})

So `import gagpo` or `import gagpo.pipeline` costs nothing until a name is read: the CLI's
`--help` and the config models load neither Polars nor torch. A name once resolved is
kept in the package's namespace, so later reads are plain attribute reads.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping


def lazy_exports(
    package: str, exports: Mapping[str, str]
) -> tuple[list[str], Callable[[str], object], Callable[[], list[str]]]:
    """`__all__`, `__getattr__` and `__dir__` for the package `package` (its `__name__`),
    whose public names are `exports`: name → the module that defines it. A name not in
    `exports` is an AttributeError, as for any module."""
    names = dict(exports)

    def __getattr__(name: str) -> object:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(names))

    return sorted(names), __getattr__, __dir__
