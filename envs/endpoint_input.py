"""What comes into the agent endpoint (envs/endpoint.py), bounded: bodies by size (413 once
that much has been read), JSON by depth (400; envs/bounded_json.py), and agent+http's `end`
by its fields."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gagpo.envs import bounded_json
from gagpo.envs.bounded_json import MAX_JSON_DEPTH
from gagpo.envs.openai_chat import RequestError
from gagpo.envs.outcome import AgentError, read_outcome

# A chat call carries the whole conversation (and its tools): 16 MiB is millions of tokens
# of text. Claims and ends carry a few fields.
MAX_CHAT_BYTES = 16 << 20
MAX_CONTROL_BYTES = 64 << 10


@dataclass(frozen=True)
class Ended:
    """The agent returned (in-process) or closed its rollout (agent+http) with `result`."""

    result: Any


@dataclass(frozen=True)
class Failed:
    """The agent raised, or an external agent gave up; `line` says why."""

    line: str


async def read_body(request, limit: int) -> bytes:
    """The request's body, read as it arrives and refused (413) once past `limit` bytes: a
    body that says it is bigger is not read at all, one that does not is read no further."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise RequestError(413, _too_big(limit))
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(413, _too_big(limit))
        chunks.append(chunk)
    return b"".join(chunks)


def _too_big(limit: int) -> str:
    return f"the request body is over {limit >> 10} KiB; accepted: at most {limit} bytes"


def read_json(body: bytes, limit: int = MAX_CONTROL_BYTES) -> Any:
    """`body` as JSON: a RequestError (one line) when it is too big (413), not JSON, or
    nested deeper than MAX_JSON_DEPTH (400; the parser's own recursion limit included)."""
    if len(body) > limit:  # an in-process agent's body is not read by `read_body`
        raise RequestError(413, _too_big(limit))
    try:
        return bounded_json.loads(body)
    except bounded_json.TooDeep:
        raise RequestError(
            400,
            f"the request body nests deeper than {MAX_JSON_DEPTH} levels; accepted: at most that",
        ) from None
    except ValueError:
        raise RequestError(400, "the request body is not JSON") from None


def read_end(body: Any, turns: int) -> Ended | Failed:
    """An agent+http `end`: `{"error": "why"}` (a non-empty string: the group is lost), or
    the outcome an in-process agent returns, checked as `read_outcome` checks that (every
    reward finite as float32). A RequestError (400, one line) otherwise."""
    if not isinstance(body, dict):
        raise RequestError(400, 'the end body is not a JSON object; accepted: {"reward": ...}')
    error = body.get("error")
    if error is not None:
        if not isinstance(error, str) or not error.strip():
            raise RequestError(
                400, f"error={_short(error)} is not valid; accepted: a non-empty string, or none"
            )
        return Failed(f"the agent gave up: {error.strip().splitlines()[0][:300]}")
    try:
        read_outcome(body, max(turns, 1))  # no call yet: the environment says so itself
    except AgentError as exc:
        raise RequestError(400, str(exc).replace("agent returned", "end got", 1)) from None
    return Ended(body)


def _short(x: object) -> str:
    text = repr(x)
    return text if len(text) <= 80 else text[:77] + "..."
