"""verifiers v1 environments as agents: `--env verifiers:PACKAGE_OR_MODULE`.

The name after `verifiers:` is a verifiers taskset id: a package or module exporting its
`Taskset` subclass (and, optionally, its `Env` subclass) through `__all__`, resolved the
way verifiers resolves it (`verifiers.v1.tasksets.<id>` first, then `<id>` itself), so
`verifiers:textarena` is verifiers' own TextArena taskset. Its environment is loaded the
verifiers way (`resolve_env_config`, `load_environment`), served once per actor process
(`Env.serving`: verifiers' interception server), and each rollout plays one episode
(`Env.run_episode`) of the task its seed names, with the run's model client pointed at
the rollout's base URL on the actor's endpoint (envs/endpoint.py). Every model call of
the episode's agents goes through verifiers' interception to that URL: one call, one
step, as for `agent:` environments (envs/agent.py).

- **Task**: a finite taskset's task `seed mod size` (in `load()` order); an infinite
  one's task number `seed`.
- **Reward**: what verifiers records on the episode's trainable traces (`Trace.reward`,
  the weighted sum of the task's `@vf.reward`s and judges, and what the env's `run` or
  `finalize` recorded), their mean if several. Won when it reaches `won_at`; truncated
  when verifiers stopped the trace at a limit of its own (`LIMITS`).
- **Harness**: a role that pins none gets the taskset's own, else the in-process chat
  loop of envs/verifiers_harness.py (verifiers' default `bash` and `null` loops
  install a script's dependencies through `uv` at run time, which needs the network);
  `harness=ID` picks another for those roles. A role that pins no runtime runs in a
  subprocess runtime (verifiers' default is a remote Prime sandbox).
- An episode that verifiers marks failed (`Episode.ok` false: a hook raised, a model
  call failed, a timeout) loses its group, with its first error in one line.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import sys
import threading
from pathlib import Path
from typing import Any

from gagpo.envs.agent import AgentEnv, AgentError
from gagpo.schemas.errors import GagpoError
from gagpo.schemas.extras import require

# verifiers' stop conditions that cut an episode at a limit (`Trace.is_truncated` also
# counts a last reply cut at its token budget, which ends no episode early).
LIMITS = (
    "max_turns",
    "max_input_tokens",
    "max_output_tokens",
    "max_total_tokens",
    "compaction_failed",
)
_PROGRAMS: dict[str, Program] = {}
_PROGRAMS_LOCK = threading.Lock()


class Program:
    """One verifiers environment, loaded once per actor process and shared by its slots:
    an agent (`async def __call__(client, task)`) that plays one episode per rollout."""

    def __init__(
        self,
        taskset_id: str,
        *,
        taskset: dict,
        env_id: str,
        harness: str | None,
        won_at: float,
        traces: str | None,
    ) -> None:
        from verifiers.v1 import load_environment, resolve_env_config

        self.won_at, self.traces = won_at, Path(traces) if traces else None
        if "." in taskset_id.rsplit("/", 1)[-1]:  # verifiers' loader cannot resolve one
            raise GagpoError(
                f"verifiers taskset {taskset_id!r} is not valid; accepted: a "
                "top-level package or module name (verifiers imports "
                "verifiers.v1.tasksets.<id>, then <id>)"
            )
        try:
            config = resolve_env_config(_env_data(taskset_id, taskset, env_id, harness))
            self.env = load_environment(config)
        except Exception as exc:
            raise GagpoError(
                f"verifiers environment {taskset_id!r} cannot be loaded: {_one_line(exc)}"
            ) from None
        self.name = taskset_id
        self._tasks: list = []
        self._source = None  # the taskset's iterator, read as far as a seed needs
        self._broken: str | None = None  # why the taskset cannot make tasks
        self._tasks_lock = threading.Lock()
        self._served: asyncio.Future | None = None  # set once `Env.serving` is entered
        self._stack = contextlib.AsyncExitStack()

    def task(self, seed: int):
        """The verifiers task of `seed` (see the module docstring); an AgentError of one
        line if the taskset cannot make it (and the same line for every later seed)."""
        with self._tasks_lock:
            if self._broken is not None:
                raise AgentError(self._broken)
            taskset = self.env.taskset
            try:
                if self._source is None:
                    self._source = iter(taskset)
                    if taskset.bounded:
                        self._tasks, self._source = list(self._source), iter(())
                if taskset.bounded and self._tasks:
                    return self._tasks[seed % len(self._tasks)]
                while len(self._tasks) <= seed:
                    self._tasks.append(next(self._source))
                return self._tasks[seed]
            except StopIteration:  # a bounded taskset with no task, or an infinite one that ended
                self._broken = f"the verifiers taskset {self.name!r} yields no task {seed}"
            except Exception as exc:
                self._broken = (
                    f"the verifiers taskset {self.name!r} failed to load its tasks: "
                    f"{_one_line(exc)}"
                )
            raise AgentError(self._broken)

    async def _serve(self) -> None:
        """Enter `Env.serving` once, on the agents' loop; it stays up for the process."""
        if self._served is None:
            self._served = asyncio.get_running_loop().create_future()
            try:
                await self._stack.enter_async_context(self.env.serving())
            except BaseException as exc:
                self._served.set_exception(exc)
                raise
            self._served.set_result(None)
        await asyncio.shield(self._served)

    async def __call__(self, client, task) -> dict:
        from verifiers.v1 import EvalClientConfig, ModelContext

        await self._serve()
        vtask = await asyncio.to_thread(self.task, task.seed)  # a taskset may build it slowly
        # The endpoint needs no key; the variable is named so verifiers reads no other one.
        endpoint = EvalClientConfig(
            base_url=str(client.base_url).rstrip("/"), api_key_var="GAGPO_VERIFIERS_API_KEY"
        )
        episode = await self.env.run_episode(vtask, ModelContext(model=task.model, client=endpoint))
        if self.traces is not None:
            self._write(task.seed, episode)
        if not episode.ok:
            error = episode.errors[0] if episode.errors else _first_error(episode)
            line = f"{error.type}: {error.message}".strip().splitlines()[0][:300] if error else "?"
            raise AgentError(f"the verifiers episode failed: {line}")
        traces = [t for t in episode.traces if t.agent is None or t.agent.trainable]
        reward = sum(t.reward for t in traces) / max(1, len(traces))
        truncated = any(t.stop_condition in LIMITS for t in traces)
        return {
            "reward": reward,
            "won": not truncated and reward >= self.won_at,
            "truncated": truncated,
        }

    def _write(self, seed: int, episode) -> None:
        """Append the episode's traces (verifiers' record form) to `traces/traces.jsonl`."""
        self.traces.mkdir(parents=True, exist_ok=True)  # type: ignore[union-attr]
        lines = [
            json.dumps({"task_seed": seed, "ok": episode.ok, "trace": t.to_record(None)})
            for t in episode.traces
        ]
        with open(self.traces / "traces.jsonl", "a") as f:  # type: ignore[operator]
            f.write("".join(line + "\n" for line in lines))


def _one_line(exc: BaseException) -> str:
    """The exception's type and its first line that says something (nltk frames its
    messages in lines of stars)."""
    plain = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    text = [line.strip() for line in plain.splitlines() if any(c.isalnum() for c in line)]
    return f"{type(exc).__name__}: {text[0][:300]}" if text else type(exc).__name__


def _first_error(episode):
    for trace in episode.traces:
        if trace.errors:
            return trace.errors[0]
    return None


def _env_data(taskset_id: str, taskset: dict, env_id: str, harness: str | None) -> dict:
    """The env config's data: the taskset, and for each role that pins no harness or
    runtime, ours (see the module docstring)."""
    from verifiers.v1 import AgentConfig, default_harness_id, env_config_type

    from gagpo.envs.verifiers_harness import HARNESS_ID

    if os.getcwd() not in sys.path:  # a module beside the command, as `agent:` finds it
        sys.path.insert(0, os.getcwd())
    data: dict[str, Any] = {"taskset": {**taskset, "id": taskset_id}, "id": env_id}
    if harness is None and default_harness_id(taskset_id) == "bash":  # the taskset has none
        harness = HARNESS_ID
    for name, field in env_config_type(taskset_id, env_id).model_fields.items():
        role = field.default
        if not isinstance(role, AgentConfig):
            continue
        pinned: dict[str, Any] = {}
        if role.harness is None and harness is not None:
            pinned["harness"] = {"id": harness}
        if "runtime" not in role.model_fields_set:
            pinned["runtime"] = {"type": "subprocess"}
        if pinned:
            data[name] = pinned
    return data


def program(taskset_id: str, **options: Any) -> Program:
    """The process's program for `taskset_id` and `options`, loaded on first use."""
    key = json.dumps([taskset_id, options], sort_keys=True, default=str)
    with _PROGRAMS_LOCK:
        if key not in _PROGRAMS:
            loaded = Program(taskset_id, **options)
            try:  # a taskset that cannot make its first task is refused here, not per group
                loaded.task(0)
            except AgentError as exc:
                raise GagpoError(str(exc)) from None
            _PROGRAMS[key] = loaded
        return _PROGRAMS[key]


class VerifiersEnv(AgentEnv):
    """`verifiers:PACKAGE_OR_MODULE`: a verifiers v1 environment; see the module docstring.

    Options: `taskset` (a table of the taskset config's fields, e.g. `{game =
    "Wordle-v0"}`), `env_id` (pair a reusable verifiers env with the taskset), `harness`
    (the harness id of roles that pin none), `won_at` (the reward at which an episode
    counts as won; default 1.0), `traces` (a folder: each episode's traces are appended
    to its traces.jsonl), and `agent:`'s (`turn_timeout_s`, `model`, `state_key`, `port`).
    """

    def __init__(
        self,
        rest: str,
        *,
        max_turns: int,
        taskset: dict | None = None,
        env_id: str = "",
        harness: str | None = None,
        won_at: float = 1.0,
        traces: str | None = None,
        **options: Any,
    ) -> None:
        require("verifiers", f"--env verifiers:{rest}")
        require("agent", f"--env verifiers:{rest}")
        if not isinstance(taskset, dict | None):
            raise GagpoError(
                f"taskset={taskset!r} is not valid; accepted: a table of the "
                "taskset config's fields"
            )
        agent = program(
            rest,
            taskset=dict(taskset or {}),
            env_id=env_id,
            harness=harness,
            won_at=float(won_at),
            traces=traces,
        )
        super().__init__(agent, max_turns=max_turns, name=f"verifiers:{rest}", **options)
