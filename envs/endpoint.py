"""The actor's agent endpoint: a loopback OpenAI-compatible server, one per actor process.

Each rollout of an agent environment (envs/agent.py) opens a *rollout* here and
gets its own base URL, `http://127.0.0.1:PORT/r/<token>/v1`, so the calls of one rollout
are tied together without a field of the agent's own. The server answers nothing by
itself: a `POST .../chat/completions` is checked (envs/openai_chat.py), handed to the
rollout's environment slot as an event, and held until the rollout loop has sampled the
reply with the actor's policy (whatever its backend and batching) and the slot answers it.

    POST /r/<token>/v1/chat/completions   one turn of that rollout
    GET  /r/<token>/v1/models, /v1/models  the one model served
    POST /gagpo/v1/rollouts                agent+http: wait for a rollout to play; its base URL
    POST /gagpo/v1/rollouts/<token>/end    agent+http: close it with its reward

What comes in is bounded (envs/endpoint_input.py): a body past its size is refused with a
413 once that much has been read, JSON nested past its depth bound with a 400 (the tool
calls' `arguments` strings included), and a handler that fails answers one line (500),
never a traceback. agent+http's
routes, and the chat calls of the rollouts it hands out, need the actor's token
(`Authorization: Bearer <token>`, the `openai` client's `api_key`): a process that can
reach the loopback port but was not given the token cannot claim, play or end a rollout.
In-process agents never meet the check: their calls do not go through HTTP.

Threads: uvicorn serves on a loop of its own; in-process agents run on another (a
blocking agent then stalls the other agents, never the server), and their client reaches
the same handlers without HTTP (`in_process`: same URLs, same replies); environment
slots block on a rollout's event queue. Starlette + uvicorn are the `view` extra's server already
(gagpo view); `openai` and they form the `agent` extra, imported when the first rollout opens.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import os
import queue
import re
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from gagpo.envs.endpoint_input import (
    MAX_CHAT_BYTES,
    MAX_CONTROL_BYTES,
    Ended,
    Failed,
    read_body,
    read_end,
    read_json,
)
from gagpo.envs.openai_chat import Call, RequestError, read_request
from gagpo.schemas.errors import GagpoError

# The agent+http token: the actor's own (made here) unless this variable sets it, so that
# whoever starts both the actor and its agent can give them the same one.
TOKEN_VARIABLE = "GAGPO_AGENT_TOKEN"
MIN_TOKEN_CHARS = 16


@dataclass(frozen=True)
class Turn:
    """An agent's call, waiting for its reply (`Endpoint.answer`)."""

    call: Call
    future: asyncio.Future


class RolloutClosed(Exception):
    """The rollout ended (its group was lost, its turn limit reached) while a call waited."""


@dataclass(eq=False)
class Rollout:
    token: str
    model: str
    base_url: str
    key_fn: Callable[[list[dict]], str] | None
    task: dict  # what an external agent receives when it claims the rollout
    events: queue.Queue = field(default_factory=queue.Queue)  # Turn | Ended | Failed
    turns: int = 0
    pending: asyncio.Future | None = None
    closed: str | None = None  # why, once closed
    agent: Future | None = None  # the in-process agent's task
    external: bool = False  # offered to agent+http: its calls need the actor's token
    tools: dict = field(default_factory=dict)  # tool_prompt, tool_parser (envs/tool_calls.py)


def one_line(exc: BaseException) -> str:
    """An exception as one short line: its type and the first line of its message."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300]}" if text else type(exc).__name__


class Endpoint:
    """The loopback server and the rollouts open on it; see the module docstring."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, token: str | None = None) -> None:
        self.token = token or secrets.token_urlsafe(32)
        self._token_told = False
        self._rollouts: dict[str, Rollout] = {}
        self._lock = threading.Lock()
        self._seats: asyncio.Queue | None = None  # agent+http: rollouts waiting for an agent
        self._client = None  # the agents' shared openai client (each rollout copies it)
        # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets that say so, and
        # without it every reply waits ~40 ms on Nagle and delayed ACKs.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise GagpoError(
                f"the agent endpoint cannot listen on {host}:{port}: {exc.strerror}"
            ) from None
        self.url = f"http://{host}:{sock.getsockname()[1]}"
        self._serve(sock)
        self.agents_loop = asyncio.new_event_loop()
        threading.Thread(target=self.agents_loop.run_forever, name="agents", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        import uvicorn

        config = uvicorn.Config(
            self._app(), log_level="warning", lifespan="off", access_log=False, server_header=False
        )
        self._server = uvicorn.Server(config)
        ready = threading.Event()

        async def serve() -> None:
            self.loop = asyncio.get_running_loop()
            self._seats = asyncio.Queue()
            ready.set()
            await self._server.serve(sockets=[sock])

        threading.Thread(
            target=asyncio.run, args=(serve(),), name="agent-endpoint", daemon=True
        ).start()
        ready.wait(10)
        deadline = time.monotonic() + 10
        while not self._server.started and time.monotonic() < deadline:
            time.sleep(0.005)
        if not self._server.started:
            raise GagpoError(f"the agent endpoint did not start on {self.url}")

    # -- rollouts (called from environment slots) ----------------------------------------

    def open(
        self, *, model: str, key_fn=None, task: dict | None = None, tools: dict | None = None
    ) -> Rollout:
        token = secrets.token_hex(16)  # the URL is the only credential of a rollout not offered
        rollout = Rollout(token, model, f"{self.url}/r/{token}/v1", key_fn, task or {})
        rollout.tools = tools or {}
        with self._lock:
            self._rollouts[token] = rollout
        return rollout

    def start_agent(self, rollout: Rollout, agent, task) -> None:
        """Run `agent(client, task)` on the agents' loop; its end becomes an event."""
        rollout.agent = asyncio.run_coroutine_threadsafe(
            self._play(rollout, agent, task), self.agents_loop
        )

    def offer(self, rollout: Rollout) -> None:
        """agent+http: make `rollout` claimable by `POST /gagpo/v1/rollouts`."""
        rollout.external = True
        self._tell_token()
        self.loop.call_soon_threadsafe(self._seats.put_nowait, rollout)  # type: ignore[union-attr]

    def _tell_token(self) -> None:
        """Print the token agent+http needs, once per process, when a rollout first needs it
        (in-process agents never do, so their runs print no secret)."""
        with self._lock:
            if self._token_told:
                return
            self._token_told = True
        given = os.environ.get(TOKEN_VARIABLE) == self.token
        print(
            f"agent+http token: {'the one in $' + TOKEN_VARIABLE if given else self.token} "
            "(send it as 'Authorization: Bearer <token>', the openai client's api_key, "
            "on claim, chat and end)",
            file=sys.stderr,
            flush=True,
        )

    def answer(self, turn: Turn, reply: dict) -> None:
        """Reply to a held call (from the slot's thread), on the loop that holds it."""
        turn.future.get_loop().call_soon_threadsafe(_settle, turn.future, reply, None)

    def refuse(self, turn: Turn, error: RequestError) -> None:
        """Answer a held call with `error` (a prompt past the context: OpenAI's 400)."""
        turn.future.get_loop().call_soon_threadsafe(_settle, turn.future, None, error)

    def close(self, rollout: Rollout, why: str) -> None:
        """End a rollout: a call it holds gets a 409 with `why`, its agent is cancelled, and
        its URL answers 404 from now on."""
        with self._lock:
            if rollout.closed is not None:
                return
            rollout.closed = why
            self._rollouts.pop(rollout.token, None)
        if rollout.agent is not None:
            rollout.agent.cancel()
        # A call is held on the server's loop (HTTP) or the agents' (in-process): on
        # either, the check of `closed` and the hold happen in one step, so a call
        # either sees the rollout closed or is failed here.
        for loop in (self.loop, self.agents_loop):
            loop.call_soon_threadsafe(self._fail_pending, rollout)

    def _fail_pending(self, rollout: Rollout) -> None:
        pending = rollout.pending
        if pending is not None and pending.get_loop() is asyncio.get_running_loop():
            _settle(pending, None, RolloutClosed(rollout.closed))

    async def _play(self, rollout: Rollout, agent, task) -> None:
        import openai

        if self._client is None or self._client._client.is_closed:
            # One client for all agents (making one costs ~0.1 s). Its transport hands a
            # request to the endpoint's handler on this loop, with no socket, HTTP parsing
            # or thread hop; agent+http and any other client go through the server.
            self._client = openai.AsyncOpenAI(
                base_url=self.url,
                api_key="gagpo",
                max_retries=0,
                timeout=3600.0,
                http_client=openai.DefaultAsyncHttpxClient(
                    transport=in_process(self), trust_env=False
                ),
            )
        client = self._client.with_options(base_url=rollout.base_url)
        try:
            result = await agent(client, task)
        except asyncio.CancelledError:
            return  # closed by its environment: nobody waits for an event
        except BaseException as exc:  # the agent's failure loses its group, nothing more
            rollout.events.put(Failed(f"agent raised {one_line(exc)}"))
            return
        rollout.events.put(Ended(result))

    # -- the server (its own loop) --------------------------------------------------------

    def _app(self):
        from starlette.applications import Starlette
        from starlette.routing import Route

        routes = [
            ("/r/{token}/v1/chat/completions", self._completions, "POST"),
            ("/r/{token}/v1/models", self._models, "GET"),
            ("/v1/models", self._models, "GET"),
            ("/gagpo/v1/rollouts", self._claim, "POST"),
            ("/gagpo/v1/rollouts/{token}/end", self._end, "POST"),
        ]
        return Starlette(
            routes=[Route(path, _guarded(handler), methods=[m]) for path, handler, m in routes]
        )

    def _authorized(self, request) -> bool:
        """The request carries the actor's token (`Authorization: Bearer <token>`); compared
        in constant time, so its answer times say nothing of the token."""
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            given.strip().encode(), self.token.encode()
        )

    async def _models(self, request):
        from starlette.responses import JSONResponse

        return JSONResponse(self.models(request.path_params.get("token")))

    async def _completions(self, request):
        from starlette.responses import JSONResponse

        token = request.path_params["token"]
        rollout = self._rollouts.get(token)
        if rollout is not None and rollout.external and not self._authorized(request):
            return _unauthorized()
        try:
            body = await read_body(request, MAX_CHAT_BYTES)
        except RequestError as exc:
            return _error_response(exc.status, str(exc))
        status, payload = await self.chat(token, body)
        return JSONResponse(payload, status_code=status)

    # -- the handlers (on the loop of whoever calls: the server, or an in-process agent) --

    def models(self, token: str | None) -> dict:
        rollout = self._rollouts.get(token or "")
        names = (
            [rollout.model] if rollout else sorted({r.model for r in list(self._rollouts.values())})
        )
        return {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "created": 0, "owned_by": "gagpo"} for name in names
            ],
        }

    async def chat(self, token: str, body: bytes) -> tuple[int, dict]:
        """One turn of rollout `token`: (HTTP status, the completion or an error)."""
        rollout = self._rollouts.get(token)
        if rollout is None:
            return _error(404, "no open rollout at this URL (it ended, or its group was lost)")
        try:
            call = read_request(
                read_json(body, MAX_CHAT_BYTES),
                model=rollout.model,
                turn=rollout.turns,
                key_fn=rollout.key_fn,
                **rollout.tools,
            )
        except RequestError as exc:
            return _error(exc.status, str(exc))
        except Exception as exc:  # a state_key callback that raised: the agent's to fix
            return _error(400, f"the state_key callback raised {one_line(exc)}")
        if rollout.pending is not None:
            return _error(
                409, "this rollout already has a call in progress; a rollout's calls are sequential"
            )
        if rollout.closed is not None:
            return _error(409, f"the rollout ended: {rollout.closed}")
        future = asyncio.get_running_loop().create_future()
        rollout.pending, rollout.turns = future, rollout.turns + 1
        rollout.events.put(Turn(call, future))
        try:
            reply = await future
        except RolloutClosed as exc:
            return _error(409, f"the rollout ended: {exc}")
        except RequestError as exc:  # refused by the rollout loop (context_length_exceeded)
            return exc.status, exc.payload()
        finally:
            rollout.pending = None
        return 200, reply

    def _rollout(self, request) -> Rollout | None:
        return self._rollouts.get(request.path_params.get("token", ""))

    async def _claim(self, request):
        from starlette.responses import JSONResponse

        if not self._authorized(request):
            return _unauthorized()
        try:
            raw = await read_body(request, MAX_CONTROL_BYTES)
            body = read_json(raw, MAX_CONTROL_BYTES) if raw.strip() else {}
        except RequestError as exc:
            return _error_response(exc.status, str(exc))
        wait_s = body.get("wait_s", 30.0) if isinstance(body, dict) else None
        if (
            not isinstance(wait_s, int | float)
            or isinstance(wait_s, bool)
            or not 0 <= wait_s <= 3600
        ):
            return _error_response(400, "wait_s must be a number of seconds in [0, 3600]")
        deadline = time.monotonic() + wait_s
        while True:
            try:
                rollout = await asyncio.wait_for(
                    self._seats.get(), max(0.0, deadline - time.monotonic())
                )  # type: ignore[union-attr]
            except TimeoutError:
                return _error_response(
                    503, f"no rollout waited to be played within {wait_s} s; ask again"
                )
            if rollout.closed is None:  # one whose environment gave up waiting is skipped
                break
        return JSONResponse(
            {
                "rollout_id": rollout.token,
                "base_url": rollout.base_url,
                "end_url": f"{self.url}/gagpo/v1/rollouts/{rollout.token}/end",
                "task": rollout.task,
            }
        )

    async def _end(self, request):
        from starlette.responses import JSONResponse

        if not self._authorized(request):
            return _unauthorized()
        rollout = self._rollout(request)
        if rollout is None:
            return _error_response(
                404, "no open rollout with this id (it ended, or its group was lost)"
            )
        try:
            event = read_end(read_json(await read_body(request, MAX_CONTROL_BYTES)), rollout.turns)
        except RequestError as exc:
            return _error_response(exc.status, str(exc))
        if rollout.pending is not None:
            return _error_response(
                409, "the rollout has a call in progress; end it after its reply"
            )
        rollout.events.put(event)
        return JSONResponse({"ok": True})


def _guarded(handler):
    """A route handler that answers one line (500) for a failure of its own, and says so in
    one line on the console: never a traceback to the client or the actor's log."""

    @functools.wraps(handler)
    async def guarded(request):
        try:
            return await handler(request)
        except Exception as exc:
            line = f"the agent endpoint failed on {request.url.path}: {one_line(exc)}"
            print(line, file=sys.stderr, flush=True)
            return _error_response(500, line)

    return guarded


def _unauthorized():
    return _error_response(
        401,
        "this route needs the actor's agent+http token (printed at its first rollout, or "
        f"${TOKEN_VARIABLE}); accepted: 'Authorization: Bearer <token>'",
    )


def _settle(future: asyncio.Future, value, error: BaseException | None) -> None:
    if not future.done():
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)


def _error(status: int, line: str) -> tuple[int, dict]:
    """An error in OpenAI's shape, so `openai` raises it with this line."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return status, {"error": {"message": line, "type": kind, "param": None, "code": None}}


def _error_response(status: int, line: str):
    from starlette.responses import JSONResponse

    status, payload = _error(status, line)
    return JSONResponse(payload, status_code=status)


_ROUTE = re.compile(r"(?:/r/([^/]+))?/v1/(chat/completions|models)")


def in_process(endpoint: Endpoint):
    """A transport for the `openai` client's HTTP library that serves the endpoint's
    rollout routes by calling its handlers on the caller's loop: what an in-process
    agent's client uses (the HTTP round trip, two event loops and the GIL between them
    cost more than a tiny policy's turn). The URLs and replies are those of the server."""
    import importlib

    import openai

    # openai 1-2 send through httpx, 3 through httpx2: the library its client class is of.
    library = next(
        c.__module__
        for c in openai.DefaultAsyncHttpxClient.__mro__
        if c.__name__ == "AsyncClient" and not c.__module__.startswith("openai")
    )
    http = importlib.import_module(library.split(".")[0])

    class InProcess(http.AsyncBaseTransport):
        async def handle_async_request(self, request):
            route = _ROUTE.fullmatch(request.url.path)
            if route is None or (request.method, route[2]) not in (
                ("POST", "chat/completions"),
                ("GET", "models"),
            ):
                status, payload = _error(
                    404, f"{request.method} {request.url.path} is not served here"
                )
            elif route[2] == "models":
                status, payload = 200, endpoint.models(route[1])
            else:
                status, payload = await endpoint.chat(route[1], await request.aread())
            return http.Response(status, json=payload)

    return InProcess()


_SHARED: dict[str, Endpoint] = {}
_SHARED_LOCK = threading.Lock()


def shared_endpoint(port: int = 0) -> Endpoint:
    """The process's endpoint, started on first use (on `port`; 0 picks a free one)."""
    with _SHARED_LOCK:
        endpoint = _SHARED.get("endpoint")
        if endpoint is None:
            from gagpo.schemas.extras import require

            require("agent", "an agent environment")
            endpoint = _SHARED["endpoint"] = Endpoint(port=port, token=_given_token())
            print(
                f"agent endpoint: {endpoint.url} (agents' base URLs: {endpoint.url}/r/<rollout>/v1; "
                f"agent+http claims rollouts at POST {endpoint.url}/gagpo/v1/rollouts)",
                file=sys.stderr,
                flush=True,
            )
        elif port and not endpoint.url.endswith(f":{port}"):
            raise GagpoError(
                f"the agent endpoint of this process already listens on {endpoint.url}, "
                f"not port {port}; accepted: one port per actor process"
            )
        return endpoint


def _given_token() -> str | None:
    """The token set in $GAGPO_AGENT_TOKEN, checked; None when unset (one is made)."""
    given = os.environ.get(TOKEN_VARIABLE)
    if not given:
        return None
    if (
        len(given) < MIN_TOKEN_CHARS
        or not given.isascii()
        or not given.isprintable()
        or " " in given
    ):
        raise GagpoError(
            f"${TOKEN_VARIABLE} is not a valid token; accepted: at least {MIN_TOKEN_CHARS} "
            "printable ASCII characters without spaces (python -c 'import secrets; "
            "print(secrets.token_urlsafe())')"
        )
    return given
