"""Agents as environments: `--env agent:MODULE:FUNCTION` and `--env agent+http`.

The user's agent, `async def agent(client, task) -> float | dict`, is played once per
rollout: `client` is an `openai.AsyncOpenAI` whose base URL is the rollout's own on the
actor's endpoint (envs/endpoint.py), and each `chat.completions.create` call is one
turn. Seen from the rollout loop an agent is an environment like any other, built once
per slot and reset per rollout:

- `reset(seed)` starts the agent and returns at its first call (observation, state key,
  and the call itself as the rollout's `chat`: the loop encodes its messages with the
  chat template, envs/openai_chat.py);
- `step(reply)` answers the held call with the sampled reply and returns at the agent's
  next call (reward 0) or its return (`done`, the episode's reward, `won`).

An agent that raises, that neither calls nor returns within `turn_timeout_s` of its last
reply, or that returns something else than a reward is an environment error: its group
is lost alone with one line, and the slot's agent is cancelled. Calls past `max_turns`
are refused (409) and the rollout is truncated. With `agent+http` the agent is another
process: it claims each rollout with `POST /gagpo/v1/rollouts` and ends it with `/end`.
"""

from __future__ import annotations

import importlib
import inspect
import os
import queue
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gagpo.envs.base import Reset, Transition
from gagpo.envs.openai_chat import Call, RequestError
from gagpo.envs.outcome import AgentError, read_outcome
from gagpo.envs.tool_calls import PARSERS, TOOL_PROMPTS
from gagpo.schemas.errors import GagpoError

DEFAULT_MODEL = "policy"


@dataclass(frozen=True)
class AgentTask:
    """What an agent is given with its client: the G rollouts of a group get the same."""

    seed: int  # the task seed: the agent's task must be a function of it
    model: str  # the model name to call (the only one the endpoint serves)
    max_turns: int  # calls past this many are refused and the rollout truncated
    options: dict[str, Any] = field(default_factory=dict)  # [actors.env_options] not the env's own


@dataclass(frozen=True)
class AgentReset(Reset):
    chat: Call | None = None  # the agent's first call (actors/rollout.py encodes it)


@dataclass(frozen=True)
class AgentTransition(Transition):
    chat: Call | None = None  # the agent's next call; None once it ended
    turn_rewards: tuple[float, ...] | None = None  # every turn's reward, given on the last


def load_function(spec: str, what: str = "agent") -> Callable:
    """`module:function` -> the function; a GagpoError of one line otherwise."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise GagpoError(
            f"{what} {spec!r} is not valid; accepted: MODULE:FUNCTION (agent:my_pkg.agents:play)"
        )
    if os.getcwd() not in sys.path:  # a module beside the command, as `uvicorn main:app` finds it
        sys.path.insert(0, os.getcwd())
    try:
        target: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except Exception as exc:
        raise GagpoError(f"{what} {spec!r} cannot be loaded: {type(exc).__name__}: {exc}") from None
    if not callable(target):
        raise GagpoError(f"{what} {spec!r} is not callable")
    return target


def is_agent(target: object) -> bool:
    """An async function (or an object with an async `__call__`): an agent."""
    return inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(
        getattr(target, "__call__", None)  # noqa: B004  # an object whose __call__ is async
    )


class AgentEnv:
    """`agent:MODULE:FUNCTION` (or an entry point naming an async function): the agent
    runs in this process, once per rollout; see the module docstring.

    Options: `turn_timeout_s` (seconds from a reply to the agent's next call or return;
    also from the start to its first call), `model` (the name the endpoint serves; the
    agent reads it from `task.model`), `state_key` (`module:function` taking the
    observation's messages and returning the state key), `port` (the endpoint's; 0: any
    free one), `tool_prompt` (`template`: a call with tools on a chat template that renders
    none gets a 400; `hermes`: the tools go into the system message as a Hermes tool
    block) and `tool_parser` (`auto`: the chat template's tool-call format; or one of
    envs/tool_calls.py's `FORMATS`). Every other option goes to the agent in `task.options`.
    """

    thread_safe = True
    stop_strings: tuple[str, ...] = ()  # an agent's reply may span lines (tool calls do)
    instructions = ""  # the agent writes its own prompts

    def __init__(
        self,
        spec: str | Callable,
        *,
        max_turns: int,
        name: str | None = None,
        turn_timeout_s: float = 60.0,
        model: str = DEFAULT_MODEL,
        state_key: str | None = None,
        port: int = 0,
        tool_prompt: str = "template",
        tool_parser: str = "auto",
        **options: Any,
    ) -> None:
        self.agent = load_function(spec) if isinstance(spec, str) else spec
        if not is_agent(self.agent):
            raise GagpoError(
                f"agent {spec!r} is not an async function; accepted: "
                "async def agent(client, task) -> float | dict"
            )
        self.name = name or f"agent:{spec}"
        if not isinstance(turn_timeout_s, int | float) or turn_timeout_s <= 0:
            raise GagpoError(
                f"turn_timeout_s={turn_timeout_s!r} is not valid; accepted: seconds > 0"
            )
        self.max_turns, self.turn_timeout_s, self.model, self.port = (
            max_turns,
            float(turn_timeout_s),
            model,
            port,
        )
        self.key_fn = load_function(state_key, "state_key") if state_key else None
        for name, value, accepted in (
            ("tool_prompt", tool_prompt, TOOL_PROMPTS),
            ("tool_parser", tool_parser, PARSERS),
        ):
            if value not in accepted:
                raise GagpoError(f"{name}={value!r} is not valid; accepted: {', '.join(accepted)}")
        self.tools = {"tool_prompt": tool_prompt, "tool_parser": tool_parser}
        self.options = options
        self._endpoint = None
        self._rollout = None
        self._turn = None  # the call held until `step` answers it
        self._keys: list[str] = []

    @classmethod
    def check(cls, rest: str, options: dict) -> None:
        """What `make_env` would refuse, without starting anything (`gagpo run --dry-run`)."""
        cls(rest, max_turns=1, **options)

    # -- the environment protocol ------------------------------------------------------

    def reset(self, task_seed: int) -> AgentReset:
        from gagpo.envs.endpoint import shared_endpoint

        self.close()
        self._endpoint = shared_endpoint(self.port)
        self._keys = []
        task = AgentTask(task_seed, self.model, self.max_turns, dict(self.options))
        self._rollout = self._endpoint.open(
            model=self.model, key_fn=self.key_fn, task=_public(task), tools=self.tools
        )
        self._start(task)
        event = self._next(self._first_wait_s())
        if not hasattr(event, "call"):
            self.close()
            raise AgentError(
                "agent ended before its first model call; a rollout needs at least one"
            )
        self._turn = event
        call = event.call
        return AgentReset(call.observation, call.state_key, None, chat=call)

    def step(self, reply: dict | RequestError) -> AgentTransition:  # type: ignore[override]
        """Answer the held call with `reply`, or with the error the rollout loop gave for
        it (a prompt past the context, tools its template cannot show: no turn,
        actors/rollout.py records no step for it)."""
        turn, self._turn = self._turn, None
        if turn is None or self._rollout is None:
            raise AgentError("step() without a call to answer")
        refused = isinstance(reply, RequestError)
        if refused:
            self._endpoint.refuse(turn, reply)  # type: ignore[union-attr]
        else:
            self._keys.append(turn.call.state_key)
            self._endpoint.answer(turn, reply)  # type: ignore[union-attr]
        event = self._next(self.turn_timeout_s, failure_ends=refused)
        if refused and not hasattr(event, "call"):
            return self._stopped_at_context(turn.call, event)
        if hasattr(event, "call"):
            call = event.call
            cut = len(self._keys) >= self.max_turns  # the call is refused: the rollout ends here
            if cut:
                self.close(f"the rollout reached its turn limit (max_turns={self.max_turns})")
            else:
                self._turn = event
            return AgentTransition(
                call.observation,
                turn.call.state_key,
                call.state_key,
                0.0,
                done=False,
                truncated=cut,
                action_valid=True,
                admissible=None,
                chat=None if cut else call,
            )
        rewards, won, truncated = read_outcome(event.result, len(self._keys))
        self.close("the agent ended")
        return AgentTransition(
            "",
            turn.call.state_key,
            None,
            rewards[-1],
            done=not truncated,
            truncated=truncated,
            action_valid=True,
            admissible=None,
            won=won,
            turn_rewards=tuple(rewards),
        )

    def expert_plan(self) -> list[str] | None:
        return None

    @classmethod
    def vocabulary(cls) -> list[str]:
        return []

    def close(self, why: str = "the environment was reset or closed") -> None:
        """Cancel the slot's agent and close its rollout (a call it holds gets a 409)."""
        if self._rollout is not None:
            self._endpoint.close(self._rollout, why)  # type: ignore[union-attr]
        self._rollout, self._turn = None, None

    # -- helpers -----------------------------------------------------------------------

    def _start(self, task: AgentTask) -> None:
        self._endpoint.start_agent(self._rollout, self.agent, task)  # type: ignore[union-attr]

    def _first_wait_s(self) -> float:
        return self.turn_timeout_s

    def _stopped_at_context(self, refused: Call, event) -> AgentTransition:
        """The agent stopped at a refused call (past the context, or tools its template
        cannot show), returning or raising (as an agent that does not catch the `openai`
        client's BadRequestError does): its rollout is truncated there, with the rewards it
        returned for its answered turns."""
        turns = len(self._keys)
        rewards = [0.0] * turns
        if hasattr(event, "result") and turns:
            rewards = read_outcome(event.result, turns)[0]
        self.close("the agent stopped at a refused call")
        return AgentTransition(
            "",
            refused.state_key,
            None,
            rewards[-1] if rewards else 0.0,
            done=False,
            truncated=True,
            action_valid=True,
            admissible=None,
            turn_rewards=tuple(rewards),
        )

    def _next(self, timeout: float, failure_ends: bool = False):
        """The rollout's next event (a call or the agent's end); an error for a failure,
        unless `failure_ends` (the agent raised at a refused call: it stopped there)."""
        try:
            event = self._rollout.events.get(timeout=timeout)  # type: ignore[union-attr]
        except queue.Empty:
            self.close("the agent timed out")
            raise TimeoutError(
                f"agent made no model call and did not end within {timeout:g} s (turn_timeout_s)"
            ) from None
        if hasattr(event, "line") and not failure_ends:
            self.close("the agent failed")
            raise AgentError(event.line)
        return event


def _public(task: AgentTask) -> dict:
    """The task as JSON, for an external agent (agent+http)."""
    return {
        "seed": task.seed,
        "model": task.model,
        "max_turns": task.max_turns,
        "options": task.options,
    }


async def _external(client, task) -> float:  # the agent of agent+http lives elsewhere
    raise AssertionError("agent+http rollouts are played by an external agent")


class AgentHTTPEnv(AgentEnv):
    """`agent+http`: an agent in another process (any language) plays the rollouts. It
    claims one with `POST /gagpo/v1/rollouts` (receives its base URL and task), calls the
    model there, and ends it with `POST .../end` and `{"reward": ..., "won": ...}` (or
    `{"error": "..."}` to give it up). Options as `agent:` plus `claim_timeout_s`: how long
    a rollout waits for an agent to claim it and call (default 600 s); `port`: set it, so
    the agent knows where to claim (the actor prints the endpoint's URL either way)."""

    def __init__(
        self, rest: str = "http", *, max_turns: int, claim_timeout_s: float = 600.0, **options: Any
    ) -> None:
        if rest != "http":
            raise GagpoError(f"environment 'agent+{rest}' is not known; accepted: agent+http")
        super().__init__(_external, max_turns=max_turns, name="agent+http", **options)
        self.claim_timeout_s = float(claim_timeout_s)

    def _start(self, task: AgentTask) -> None:
        self._endpoint.offer(self._rollout)  # type: ignore[union-attr]

    def _first_wait_s(self) -> float:
        return self.claim_timeout_s
