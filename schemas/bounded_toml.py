"""TOML from the user, read within bounds: a recipe, a `--config` file, a `--set` value,
an `--env-options` table.

tomllib parses nested inline tables and arrays by recursion, so a value nested a few
hundred levels deep ends in a RecursionError, and reading `--config /dev/zero` never ends
(a MemoryError). Here a file must be a regular file of at most `MAX_TOML_BYTES`, and a
document nested deeper than `MAX_TOML_DEPTH` tables and arrays (inline or dotted) is
refused in one line, whether the parser ran out of stack or the parsed document is too
deep for the code that walks it (pydantic, the key checks) to be safe.
"""

from __future__ import annotations

import os
import stat
import tomllib
from pathlib import Path
from typing import Any

from gagpo.schemas.errors import GagpoError

MAX_TOML_BYTES = 1 << 20  # 1 MiB: the shipped recipes are about 2 KiB
MAX_TOML_DEPTH = 32  # a recipe is 4 deep ([learner.estimator] and a value); env options more


def loads(text: str, what: str) -> dict[str, Any]:
    """`text` parsed as TOML; a GagpoError naming `what` when it is nested too deep.
    tomllib's own TOMLDecodeError is left to the caller (each words it its way)."""
    try:
        data = tomllib.loads(text)
    except RecursionError:
        data = None
    if data is None or depth(data) > MAX_TOML_DEPTH:
        raise GagpoError(
            f"{what} nests tables or arrays deeper than {MAX_TOML_DEPTH} levels; accepted: "
            f"TOML nested at most {MAX_TOML_DEPTH} deep"
        )
    return data


def depth(value: Any, limit: int = MAX_TOML_DEPTH) -> int:
    """How many tables and arrays (dicts and lists) deep `value` is (a scalar: 0), walked
    without recursion; past `limit` the walk stops and returns a depth above it. Parsed
    JSON is measured by the same walk (envs/bounded_json.py)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, level = todo.pop()
        children = (
            item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        )
        if children is None:
            continue
        deepest = max(deepest, level)
        if level > limit:  # deep enough to refuse: stop walking
            return level
        todo.extend((child, level + 1) for child in children)
    return deepest


def read_text(path: Path, what: str) -> str:
    """The text of the regular file `path`, at most `MAX_TOML_BYTES`; one GagpoError line
    for a device, a FIFO or a folder (opened without blocking, never read), a larger file,
    or text that is not UTF-8. FileNotFoundError and PermissionError pass to the caller."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = "a folder" if stat.S_ISDIR(info.st_mode) else "not a regular file"
            raise GagpoError(f"{what} is {kind}; accepted: a TOML file")
        raw = handle.read(MAX_TOML_BYTES + 1)  # a file that grows meanwhile is cut here
    if len(raw) > MAX_TOML_BYTES:
        raise GagpoError(
            f"{what} holds more than {MAX_TOML_BYTES >> 20} MiB; accepted: a TOML file of at "
            f"most {MAX_TOML_BYTES >> 20} MiB"
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise GagpoError(
            f"{what} is not UTF-8 text ({exc.reason} at byte {exc.start}); accepted: a TOML file"
        ) from None
