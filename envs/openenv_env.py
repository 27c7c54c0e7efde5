"""Environments served over OpenEnv's HTTP protocol (`--env openenv+http://HOST:PORT`).

OpenEnv (Meta PyTorch, `openenv-core`) serves an environment with three routes:

    POST /reset  {"seed": s, "episode_id": id}  -> {"observation": {...}, "reward": r, "done": d}
    POST /step   {"action": {...}}              -> {"observation": {...}, "reward": r, "done": d}
    GET  /state                                 -> {"episode_id": id, "step_count": n, ...}

and answers an action that does not fit its action schema with HTTP 422. Nothing of
openenv-core is imported: the adapter speaks the protocol with the standard library, so
any server that follows it fits (tests/test_adapters_openenv.py starts one on loopback).

- the action is `{action_key: reply}` (default "message", OpenEnv's text action field);
- the observation text is `observation[observation_key]`, default the first of
  "prompt", "text", "message", "echoed_message" present, else the observation as JSON;
- admissible commands: `observation[admissible_key]` (default "legal_actions") where it
  is a list;
- state key: `/state` without its bookkeeping (`episode_id`, `step_count`) as sorted-key
  JSON where the server puts the environment's own fields there, else the observation
  as sorted-key JSON;
- invalid: an HTTP 422 (the state is unchanged, reward 0), or `observation[valid_key]`
  (default "action_valid") false where the observation carries it;
- won: `observation[won_key]` (default "won") where present, else derived: the episode
  ended with a reward of at least `won_reward` (default 1.0);
- one server holds one episode, so each rollout slot needs its own: the URL may list
  several, `openenv+http://h:8001,h:8002`; each adapter holds the first one no other live
  adapter on the machine holds (a lock file per server, given back by `close()`); more
  slots than servers, or a server reset by another client (its `/state` names another
  episode), is one line;
- a server that stops answering mid-episode (refused, reset, timed out, a 5xx) raises
  `EnvironmentLost`: the rollout loop loses that group alone and says so in one line. A
  reset waits up to `reset_wait_s` (10 s) for a server that refuses connections, so one
  restarted by its supervisor serves the next group.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import tempfile
import time
import urllib.error
import urllib.request
import uuid
import weakref
from typing import Any

from gagpo.envs.base import Reset, Transition
from gagpo.envs.library import LibraryEnv, canonical
from gagpo.schemas.errors import GagpoError

PREFIX = "openenv+"
TEXT_KEYS = ("prompt", "text", "message", "echoed_message")
_BOOKKEEPING = ("episode_id", "step_count")


class EnvironmentLost(GagpoError):
    """The environment stopped answering mid-episode; its group cannot be finished."""

    def __init__(self, message: str, *, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused  # the connection was refused: nothing is listening (yet)


def _claim(url: str, servers: list[str]) -> tuple[int, int]:
    """(index, lock fd) of the first server no other live adapter on this machine holds.

    The hold is an exclusive `flock` on a file per server in the temporary folder, so it
    spans threads, the worker processes of `--env-executor process` and other actors on
    the machine alike; the kernel drops it with the descriptor, even on a crash."""
    for index, server in enumerate(servers):
        digest = hashlib.sha1(server.encode()).hexdigest()[:16]
        path = os.path.join(tempfile.gettempdir(), f"gagpo-openenv-{digest}.lock")
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return index, fd
    raise GagpoError(
        f"environment 'openenv+{url}': all {len(servers)} of its servers are held by other "
        "rollout slots; one server holds one episode, so list one per slot "
        "(groups in flight x group size): openenv+http://HOST:PORT,HOST:PORT,..."
    )


def _servers(url: str) -> list[str]:
    """`http://h:1,h:2` -> ["http://h:1", "http://h:2"]."""
    scheme, sep, rest = url.partition("://")
    if scheme != "http" or not sep or not rest.strip("/"):
        raise GagpoError(
            f"environment 'openenv+{url}': accepted: openenv+http://HOST:PORT[,HOST:PORT...]"
        )
    return [f"http://{part.strip().rstrip('/')}" for part in rest.split(",") if part.strip()]


class OpenEnvHTTP(LibraryEnv):
    """One OpenEnv server over HTTP (see the module docstring)."""

    def __init__(
        self,
        url: str,
        *,
        max_turns: int,
        action_key: str = "message",
        observation_key: str | None = None,
        admissible_key: str = "legal_actions",
        valid_key: str = "action_valid",
        won_key: str = "won",
        won_reward: float = 1.0,
        timeout_s: float = 30.0,
        reset_wait_s: float = 10.0,
        instructions: str | None = None,
    ) -> None:
        super().__init__(f"{PREFIX}{url}", max_turns)
        servers = _servers(url)
        index, fd = _claim(url, servers)  # each slot holds a server of its own
        self.server = servers[index]
        self._release = weakref.finalize(self, os.close, fd)
        self._action_key = action_key
        self._observation_key = observation_key
        self._admissible_key = admissible_key
        self._valid_key = valid_key
        self._won_key = won_key
        self._won_reward = won_reward
        self._timeout = timeout_s
        self._reset_wait = reset_wait_s
        self._instructions = instructions
        self._episode = ""
        self._observation: dict[str, Any] = {}
        self._admissible: tuple[str, ...] | None = None

    # --- the wire ---------------------------------------------------------------------

    def _call(self, method: str, route: str, body: dict | None = None) -> tuple[int, Any]:
        """(HTTP status, JSON body) of one request; EnvironmentLost when the server is gone.
        A reset waits up to `reset_wait_s` for a server that refuses connections (starting,
        or restarted by its supervisor): no episode is lost by waiting there."""
        deadline = time.monotonic() + (self._reset_wait if route == "/reset" else 0.0)
        while True:
            try:
                return self._request(method, route, body)
            except EnvironmentLost as lost:
                if not lost.refused or time.monotonic() >= deadline:
                    raise
                time.sleep(0.1)

    def _request(self, method: str, route: str, body: dict | None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.server + route,
            data=data,
            method=method,
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=self._timeout) as response:
                return response.status, json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            if exc.code >= 500:
                raise self._lost(route, f"HTTP {exc.code}") from None
            try:
                detail = json.loads(exc.read() or b"null")
            except ValueError:
                detail = None
            return exc.code, detail
        except (OSError, ValueError) as exc:  # refused, reset, timed out, not JSON
            reason = getattr(exc, "reason", exc)
            refused = isinstance(reason, ConnectionRefusedError)
            raise self._lost(route, f"{type(reason).__name__}: {reason}", refused) from None

    def _lost(self, route: str, why: str, refused: bool = False) -> EnvironmentLost:
        where = "at reset" if route == "/reset" else f"at turn {self._turn + 1}"
        return EnvironmentLost(
            f"OpenEnv server {self.server} stopped answering {route} {where} ({why})",
            refused=refused,
        )

    def _state(self) -> str:
        status, state = self._call("GET", "/state")
        if status != 200 or not isinstance(state, dict):
            raise GagpoError(f"OpenEnv server {self.server}: GET /state answered HTTP {status}")
        episode = state.get("episode_id")
        if episode is not None and self._episode and episode != self._episode:
            raise GagpoError(
                f"OpenEnv server {self.server} was reset by another rollout (episode {episode}, "
                f"not {self._episode}); give each rollout slot its own server: "
                "openenv+http://HOST:PORT,HOST:PORT,..."
            )
        own = {k: v for k, v in state.items() if k not in _BOOKKEEPING}
        return canonical(own) if own else canonical(self._observation)

    def _text(self, observation: dict[str, Any]) -> str:
        if self._observation_key is not None:
            return str(observation.get(self._observation_key, ""))
        for key in TEXT_KEYS:
            if isinstance(observation.get(key), str):
                return observation[key]
        return canonical(observation)

    def _read(self, status: int, body: Any, route: str) -> tuple[dict[str, Any], float, bool]:
        if (
            status != 200
            or not isinstance(body, dict)
            or not isinstance(body.get("observation"), dict)
        ):
            raise GagpoError(
                f"OpenEnv server {self.server}: {route} answered HTTP {status} with "
                f"{type(body).__name__}; accepted: {{'observation': {{...}}, 'reward', 'done'}}"
            )
        observation = body["observation"]
        commands = observation.get(self._admissible_key)
        self._admissible = tuple(map(str, commands)) if isinstance(commands, list) else None
        self._observation = observation
        return observation, float(body.get("reward") or 0.0), bool(body.get("done", False))

    # --- the protocol -----------------------------------------------------------------

    def reset(self, task_seed: int) -> Reset:
        self._episode = uuid.uuid4().hex
        status, body = self._call(
            "POST", "/reset", {"seed": task_seed, "episode_id": self._episode}
        )
        observation, _, _ = self._read(status, body, "/reset")
        self._begin(self._state())
        return Reset(self._text(observation), self._key, self._admissible)

    def step(self, reply: str) -> Transition:
        self._check_running()
        status, body = self._call("POST", "/step", {"action": {self._action_key: reply}})
        if status == 422:  # the action does not fit the schema: nothing happened
            detail = body.get("detail") if isinstance(body, dict) else body
            return self._end_turn(
                observation=f"The environment refused the action: {json.dumps(detail)[:300]}",
                reward=0.0,
                done=False,
                valid=False,
                won=False,
                key=self._key,
                admissible=self._admissible,
            )
        observation, reward, done = self._read(status, body, "/step")
        valid = bool(observation.get(self._valid_key, True))
        won = observation.get(self._won_key)
        won = bool(won) if won is not None else reward >= self._won_reward
        return self._end_turn(
            observation=self._text(observation),
            reward=reward,
            done=done,
            valid=valid,
            won=done and won,
            key=self._state(),
            admissible=self._admissible,
        )

    def close(self) -> None:
        """Give the server back (the slot is rebuilt, or the actor ends)."""
        self._release()

    @property
    def instructions(self) -> str:
        return self._instructions or (
            "You act in an environment served over OpenEnv. Read each observation and reply "
            "with exactly one action."
        )
