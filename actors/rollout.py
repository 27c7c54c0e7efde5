"""The rollout loop: K groups in flight, G rollouts each, their next turns generated together.

`Rollouts` keeps up to K groups (the actor's `groups_in_flight`) in play at once. Each
rollout sits in an environment slot (actors/slots.py: built once, reset per rollout),
and environment steps run off the main thread. Two ways to reach the engine:

- **lockstep** (the transformers backend, and demonstrations): every live rollout of
  every group in flight that is waiting for a reply goes into one `generate` call; their
  environment steps then run in parallel; then the next round. The schedule does not
  depend on timing, so a run is reproducible for a given K: a round's sampling seed
  derives from the (group seed, turn) of its rows, and is `group seed + turn` when the
  round holds one group's turn, as in the one-group-at-a-time loop.
- **continuous** (backends with `submit`/`poll`: vLLM): a reply's request is submitted
  as soon as its rollout's environment step has returned, and the engine is stepped
  while environments work, so no rollout waits for the slowest of its turn. Each request
  has its own seed, `request_seed(group seed + turn, j)` for rollout j, so a sample does
  not depend on what it was batched with.

Every step records the policy version that sampled it (`policy_version`). The actor
loads a new version between turns (`hold` drains the engine first, so no reply mixes two
versions); a group may therefore span versions, and the learner measures its staleness
on its oldest step (docs/design.md §6). A group is handed back the moment its last
rollout ends, whatever the order groups started in. A group whose environment raises
is lost alone: its rollouts are dropped, the requests it had in the engine aborted, and
the others go on (`GroupLost`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from datetime import UTC, datetime
from itertools import count
from typing import Any

from gagpo.actors.policies.base import PolicyBackend, Sample, request_seed
from gagpo.actors.prompts import build_messages
from gagpo.actors.slots import Slots, Started
from gagpo.envs.base import Environment
from gagpo.envs.parse import parse_action
from gagpo.schemas import columns as C
from gagpo.schemas.seeds import derive_seed

# Replies chosen by someone other than the policy (an expert): one per (env, admissible).
Demonstrator = Callable[[list[Environment], list[tuple[str, ...] | None]], list[Sample]]


@dataclass(frozen=True)
class GroupTask:
    """One group to play: task `task_seed`, G rollouts sampled from `sampling_seed`."""

    index: int  # the actor's group counter k (task seed = seed + k)
    task_seed: int
    group_id: str
    sampling_seed: int
    demonstrator: Demonstrator | None = None


@dataclass
class GroupResult:
    """The rows of one finished group (column name -> values; `shard_id` is set when it is
    committed) and what they add up to."""

    task: GroupTask
    columns: dict[str, list]
    rollouts: int
    steps: int
    successes: int
    versions: set[int]
    seconds_generate: float = 0.0  # set by `rollout_group` only: groups in flight share time
    seconds_env: float = 0.0


@dataclass(frozen=True)
class GroupLost:
    """A group dropped because its environment raised; the others were not affected."""

    task: GroupTask
    reason: str


@dataclass(eq=False)
class _Group:
    task: GroupTask
    lane: int
    env_name: str = ""
    instructions: str = ""
    rollouts: list[_Rollout] = field(default_factory=list)
    columns: dict[str, list] = field(default_factory=lambda: {n: [] for n in C.STEPS_COLUMNS})
    started: int = 0  # rollouts whose reset returned
    outstanding: int = 0  # environment calls not yet returned
    lost: str | None = None


@dataclass(eq=False)
class _Rollout:
    group: _Group
    j: int
    slot: int
    traj_id: str
    observation: str = ""
    state_key: str = ""
    admissible: tuple[str, ...] | None = None
    history: list[tuple[str, str]] = field(default_factory=list)
    step: int = 0
    ended: bool = False
    won: bool = False
    # An agent's call (envs/agent.py): the prompt is its own messages, and the
    # reply goes back to it whole; `rows` are its steps' rows (turn rewards come last).
    chat: Any = None
    rows: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class _Reply:
    """A sampled reply on its way through the environment."""

    rollout: _Rollout
    prompt: list[int]
    sample: Sample
    version: int


class Rollouts:
    """Up to `capacity` groups of `group_size` rollouts in flight; see the module docstring."""

    def __init__(
        self,
        slots: Slots,
        policy: PolicyBackend,
        *,
        group_size: int,
        history_window: int,
        capacity: int,
        run_id: str,
        continuous: bool | None = None,
    ) -> None:
        if slots.size < capacity * group_size:
            raise ValueError(f"{slots.size} slots cannot hold {capacity} groups of {group_size}")
        self.slots, self.policy = slots, policy
        self.group_size, self.history_window, self.run_id = group_size, history_window, run_id
        self.continuous = hasattr(policy, "submit") if continuous is None else continuous
        self._lanes = list(range(capacity))  # free lanes; lane i owns slots i·G … i·G+G−1
        self._groups: list[_Group] = []  # in flight, in start order
        self._env: dict[Future, tuple[_Rollout, _Reply | None]] = {}  # calls not yet absorbed
        self._ready: list[_Rollout] = []  # waiting for a reply
        self._requests: dict[str, tuple[_Rollout, list[int], int]] = {}  # continuous: in engine
        self._finished: list[GroupResult | GroupLost] = []
        self._ids = count()
        self.seconds_generate = 0.0  # wall time in engine calls
        self.seconds_env = 0.0  # wall time the main thread waited for environments

    @property
    def in_flight(self) -> int:
        return len(self._groups)

    @property
    def free(self) -> int:
        """Groups that can start now."""
        return len(self._lanes)

    @property
    def generating(self) -> int:
        """Replies in the engine (continuous); a new policy version waits for zero."""
        return len(self._requests)

    def start(self, task: GroupTask) -> None:
        """Reset G slots for `task`; its first turn is generated once all G have reset."""
        group = _Group(task, self._lanes.pop(0))
        for j in range(self.group_size):
            r = _Rollout(group, j, group.lane * self.group_size + j, f"{task.group_id}-{j}")
            group.rollouts.append(r)
            self._call(self.slots.reset(r.slot, task.task_seed), r, None)
        self._groups.append(group)

    def advance(self, *, hold: bool = False) -> list[GroupResult | GroupLost]:
        """One round; the groups that finished or were lost in it. `hold`: submit nothing
        new to the engine (to drain it before a new policy version is loaded)."""
        if self.continuous:
            self._round_continuous(hold)
        elif not hold:
            self._round_lockstep()
        finished, self._finished = self._finished, []
        return finished

    def drain(self) -> None:
        """Finish the replies in the engine, submitting none (before a new version is
        loaded); groups that finish meanwhile are returned by the next `advance`."""
        while self._requests:
            self._round_continuous(hold=True)

    def close(self) -> None:
        """Abort what is still in the engine (groups in flight are abandoned)."""
        if self._requests and hasattr(self.policy, "abort"):
            self.policy.abort(list(self._requests))
        self._requests.clear()

    # -- rounds ------------------------------------------------------------------------

    def _round_lockstep(self) -> None:
        self._absorb(block="all")
        ready = sorted(self._ready, key=lambda r: (r.group.task.index, r.j))
        self._ready = []
        if not ready:
            return
        prompts = {id(r): self._prompt(r) for r in ready}
        ready = [r for r in ready if r.group.lost is None]  # an agent's chat may be refused
        version = self.policy.version
        t0 = time.perf_counter()
        samples: dict[int, Sample] = {}
        sampled = [r for r in ready if r.group.task.demonstrator is None]
        if sampled:
            seed = _round_seed([(r.group.task.sampling_seed, r.step) for r in sampled])
            replies = self.policy.generate([prompts[id(r)] for r in sampled], seed=seed)
            for r, s in zip(sampled, replies, strict=True):
                samples[id(r)] = s
        demonstrated = [r for r in ready if r.group.task.demonstrator is not None]
        for group in {id(r.group): r.group for r in demonstrated}.values():
            rows = [r for r in ready if r.group is group]
            envs = [self.slots.env(r.slot) for r in rows]
            for r, s in zip(
                rows, group.task.demonstrator(envs, [r.admissible for r in rows]), strict=True
            ):  # type: ignore[misc]
                samples[id(r)] = s
        self.seconds_generate += time.perf_counter() - t0
        for r in ready:
            self._send(r, prompts[id(r)], samples[id(r)], version)
        self._absorb(block="all")

    def _round_continuous(self, hold: bool) -> None:
        # With nothing in the engine, wait for an environment: there is no other work.
        self._absorb(block="one" if not self._requests else "none")
        if not hold:
            version = self.policy.version
            for r in sorted(self._ready, key=lambda r: (r.group.task.index, r.j)):
                prompt = self._prompt(r)
                if prompt is None:  # an agent's chat its template refused: the group is lost
                    continue
                key = f"{self.run_id}-{next(self._ids)}"
                seed = request_seed(r.group.task.sampling_seed + r.step, r.j)
                self.policy.submit(key, prompt, seed=seed)  # type: ignore[attr-defined]
                self._requests[key] = (r, prompt, version)
            self._ready = []
        if not self._requests:
            return
        t0 = time.perf_counter()
        done = self.policy.poll()  # type: ignore[attr-defined]  # one engine step
        self.seconds_generate += time.perf_counter() - t0
        for key, sample in done:
            r, prompt, version = self._requests.pop(key)
            if r.group.lost is None:
                self._send(r, prompt, sample, version)

    # -- environment calls -------------------------------------------------------------

    def _prompt(self, r: _Rollout) -> list[int] | None:
        if r.group.lost is not None:
            return None
        if r.chat is not None:  # an agent's messages and tools, through the chat template
            try:
                return r.chat.encode(self.policy)
            except Exception as exc:  # e.g. roles a template refuses: this group alone is lost
                self._lose(r.group, f"the chat template refused the agent's call: {exc}")
                if r.group.outstanding == 0 and r.group in self._groups:
                    self._groups.remove(r.group)
                    self._lanes.append(r.group.lane)
                return None
        messages = build_messages(
            r.group.instructions, r.history, r.observation, r.admissible, self.history_window
        )
        return self.policy.encode_chat(messages)

    def _send(self, r: _Rollout, prompt: list[int], sample: Sample, version: int) -> None:
        if r.chat is not None:  # the agent gets the reply as an OpenAI chat completion
            sample = r.chat.fit(sample, self.policy)
            action = r.chat.respond(prompt, sample, version, self.policy)
        else:
            action = parse_action(sample.text, r.admissible)
        self._call(self.slots.step(r.slot, action), r, _Reply(r, prompt, sample, version))

    def _call(self, future: Future, r: _Rollout, reply: _Reply | None) -> None:
        r.group.outstanding += 1
        self._env[future] = (r, reply)

    def _absorb(self, block: str) -> None:
        """Take in the environment calls that returned: all of them (`all`), at least one
        (`one`), or those already done (`none`)."""
        if not self._env:
            return
        t0 = time.perf_counter()
        if block == "all":
            done = set(wait(self._env).done)
        elif block == "one":
            done = set(wait(self._env, return_when=FIRST_COMPLETED).done)
        else:
            done = {f for f in self._env if f.done()}
        self.seconds_env += time.perf_counter() - t0
        for future in [f for f in self._env if f in done]:  # in submission order
            r, reply = self._env.pop(future)
            r.group.outstanding -= 1
            error = future.exception()
            if r.group.lost is not None:
                pass
            elif error is not None:
                self.slots.discard(r.slot)
                self._lose(r.group, f"environment raised {type(error).__name__}: {error}")
            elif reply is None:
                self._started(r, future.result())
            else:
                self._stepped(reply, future.result())
            if r.group.lost is not None and r.group.outstanding == 0 and r.group in self._groups:
                self._groups.remove(r.group)
                self._lanes.append(r.group.lane)

    def _started(self, r: _Rollout, started: Started) -> None:
        first, group = started.reset, r.group
        r.observation, r.state_key, r.admissible = (
            first.observation,
            first.state_key,
            first.admissible,
        )
        r.chat = getattr(first, "chat", None)
        group.env_name, group.instructions = started.env_name, started.instructions
        group.started += 1
        if group.started < self.group_size:
            return
        keys = {x.state_key for x in group.rollouts}
        if len(keys) != 1:
            self._lose(
                group,
                f"environment {group.env_name} is not deterministic given its seed "
                f"({len(keys)} first states for task seed {group.task.task_seed})",
            )
            return
        self._ready.extend(group.rollouts)

    def _stepped(self, reply: _Reply, tr) -> None:
        r, group, sample = reply.rollout, reply.rollout.group, reply.sample
        task = group.task
        row = {
            C.RUN_ID: self.run_id,
            C.SHARD_ID: None,
            C.GROUP_ID: task.group_id,
            C.TRAJ_ID: r.traj_id,
            C.STEP: r.step,
            C.ENV: group.env_name,
            C.TASK_ID: f"{group.env_name}-{task.task_seed}",
            C.STATE_KEY: tr.state_key,
            C.NEXT_STATE_KEY: tr.next_state_key,
            C.OBSERVATION: r.observation,
            C.PROMPT_IDS: reply.prompt,
            C.ACTION_TEXT: sample.text,
            C.ACTION_IDS: sample.token_ids,
            C.BEHAVIOR_LOGPROBS: sample.logprobs,
            C.POLICY_VERSION: reply.version,
            C.REWARD: tr.reward,
            C.DONE: tr.done,
            C.TRUNCATED: tr.truncated,
            C.ACTION_VALID: tr.action_valid,
            C.WON: tr.won,
            C.CREATED_AT: datetime.now(UTC),
        }
        for name, value in row.items():
            group.columns[name].append(value)
        r.rows.append(len(group.columns[C.STEP]) - 1)
        for i, reward in zip(r.rows, getattr(tr, "turn_rewards", None) or (), strict=False):
            group.columns[C.REWARD][i] = reward  # an agent's per-turn rewards, known at its end
        r.history.append((r.observation, sample.text))
        r.observation, r.state_key, r.admissible = tr.observation, tr.next_state_key, tr.admissible
        r.chat = getattr(tr, "chat", None)
        r.step += 1
        r.ended = tr.done or tr.truncated
        r.won = tr.won
        if not r.ended:
            self._ready.append(r)
        elif all(x.ended for x in group.rollouts):
            self._groups.remove(group)
            self._lanes.append(group.lane)
            self._finished.append(
                GroupResult(
                    task=task,
                    columns=group.columns,
                    rollouts=self.group_size,
                    steps=len(group.columns[C.STEP]),
                    successes=sum(x.won for x in group.rollouts),
                    versions=set(group.columns[C.POLICY_VERSION]),
                )
            )

    def _lose(self, group: _Group, reason: str) -> None:
        group.lost = reason
        self._ready = [r for r in self._ready if r.group is not group]
        mine = [k for k, (r, _, _) in self._requests.items() if r.group is group]
        for key in mine:
            del self._requests[key]
        if mine and hasattr(self.policy, "abort"):
            self.policy.abort(mine)
        self._finished.append(GroupLost(group.task, reason))


def _round_seed(rows: list[tuple[int, int]]) -> int:
    """The sampling seed of a lockstep round from its rows' (group seed, turn): the group's
    seed + turn when the round is one group's turn, else a digest of all of them."""
    distinct = sorted(set(rows))
    if len(distinct) == 1:
        return distinct[0][0] + distinct[0][1]
    return derive_seed(repr(distinct), bits=63)


def rollout_group(
    make_env: Callable[[], Environment],
    policy: PolicyBackend,
    *,
    task_seed: int,
    group_id: str,
    run_id: str,
    shard_id: str,
    group_size: int,
    history_window: int,
    sampling_seed: int,
    demonstrator: Demonstrator | None = None,
) -> GroupResult:
    """Play one group to its end on fresh environments (the actor loop keeps K groups in
    flight instead; this is for callers that want one group). With a `demonstrator` its
    replies are played instead of the policy's (actors/demos.py); the prompts are still
    the policy's, so demonstrations train on what RL will see. An environment that raises
    raises here."""
    task = GroupTask(0, task_seed, group_id, sampling_seed, demonstrator)
    with Slots(make_env, group_size, executor="inline") as slots:
        runner = Rollouts(
            slots,
            policy,
            group_size=group_size,
            history_window=history_window,
            capacity=1,
            run_id=run_id,
            continuous=None if demonstrator is None else False,
        )
        runner.start(task)
        while True:
            for outcome in runner.advance():
                if isinstance(outcome, GroupLost):
                    raise RuntimeError(outcome.reason)
                outcome.columns[C.SHARD_ID] = [shard_id] * outcome.steps
                outcome.seconds_generate = runner.seconds_generate
                outcome.seconds_env = runner.seconds_env
                return outcome
