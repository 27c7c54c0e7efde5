"""JSON from outside, parsed with a depth bound: request bodies, the `arguments` strings of
the tool calls an agent sends back, and the JSON a model writes in its tool calls.

Deep enough for any tool's JSON schema; shallow enough that nothing downstream (the chat
template's `tojson`, `json.dumps`) nears the interpreter's recursion limit. Issue 46: a
tool call whose `arguments` string nested 900 deep passed the body's bound (it is one
string there) and failed later, in the chat template, losing its group.
"""

from __future__ import annotations

import json
from typing import Any

from gagpo.schemas.bounded_toml import depth

MAX_JSON_DEPTH = 64


class TooDeep(ValueError):
    """JSON nested deeper than its bound."""


def loads(text: str | bytes, limit: int = MAX_JSON_DEPTH) -> Any:
    """`json.loads(text)`; TooDeep past `limit` levels (the parser's own recursion limit
    included), ValueError (json.JSONDecodeError) for what is not JSON."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise TooDeep(f"nests deeper than {limit} levels") from None
    if depth(value, limit) > limit:
        raise TooDeep(f"nests deeper than {limit} levels")
    return value
