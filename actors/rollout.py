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

Prompts (issue 38): a turn's prompt ids extend the previous turn's prompt and sampled
reply ids wherever the chat holds that reply unchanged (actors/policies/prompt_ids.py), so
the tokens a policy sampled are the tokens the next prompt holds. A step whose prompt does
not is counted per group as a window slide (a history window dropped its oldest turn) or
as drift (anything else), by the one rule of schemas/extends.py. A prompt past the policy's limits is never cut inside
a turn: a native environment's oldest whole turns are dropped (actors/prompts.py), and a
rollout whose current turn alone does not fit ends truncated; an agent's call gets
OpenAI's 400 `context_length_exceeded` and no step (envs/openai_chat.py).
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
from gagpo.actors.policies.prompt_ids import Prior, encode_prompt
from gagpo.actors.prompts import build_messages, fit_messages, user_turn
from gagpo.actors.slots import Slots, Started
from gagpo.envs.base import Environment
from gagpo.envs.openai_chat import RequestError
from gagpo.envs.parse import parse_action
from gagpo.schemas import columns as C
from gagpo.schemas import extends
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
    # Steps after a rollout's first whose prompt does not extend the previous step's prompt
    # and action (schemas/extends.py): drift, and window slides (a history window moved on).
    drift: int = 0
    slides: int = 0


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
    drift: int = 0
    slides: int = 0


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
    prior: Prior | None = None  # its last recorded turn: what the next prompt may extend
    refused: str = ""  # the last call the loop refused, and why (its 400's line)


@dataclass(frozen=True)
class _Prompt:
    """A turn's prompt: its ids and the chat they render."""

    ids: list[int]
    messages: tuple[dict, ...]
    tools: tuple[dict, ...] | None
    text: str | None  # the template's rendering (None for a stand-in policy)
    budget: int | None = None  # an agent's reply budget (its max_tokens); None: native
    starts: tuple[int | None, ...] = ()  # where its messages begin in `ids` (prompt_ids.py)


@dataclass(frozen=True)
class _Reply:
    """A sampled reply on its way through the environment."""

    rollout: _Rollout
    prompt: _Prompt | None  # None: the call was refused (past the context), nothing sampled
    sample: Sample | None
    version: int
    answer: dict | None = None  # the assistant message the chat holds for the reply


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
        self._requests: dict[str, tuple[_Rollout, _Prompt, int]] = {}  # continuous: in engine
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
        # An agent's chat may be refused (its group lost, or the call past the context),
        # and a rollout whose turn does not fit ends.
        ready = [r for r in ready if r.group.lost is None and prompts[id(r)] is not None]
        version = self.policy.version
        t0 = time.perf_counter()
        samples: dict[int, Sample] = {}
        sampled = [r for r in ready if r.group.task.demonstrator is None]
        if sampled:
            seed = _round_seed([(r.group.task.sampling_seed, r.step) for r in sampled])
            budgets = [prompts[id(r)].budget for r in sampled]
            extra = {"max_tokens": budgets} if any(b is not None for b in budgets) else {}
            replies = self.policy.generate(
                [prompts[id(r)].ids for r in sampled], seed=seed, **extra
            )
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
                if prompt is None:  # refused, past the context, or its group lost
                    continue
                key = f"{self.run_id}-{next(self._ids)}"
                seed = request_seed(r.group.task.sampling_seed + r.step, r.j)
                extra = {} if prompt.budget is None else {"max_tokens": prompt.budget}
                self.policy.submit(key, prompt.ids, seed=seed, **extra)  # type: ignore[attr-defined]
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

    def _prompt(self, r: _Rollout) -> _Prompt | None:
        """The rollout's next prompt; None where there is none to sample: its group is
        lost, its agent's call is refused, or its turn does not fit (the rollout ends)."""
        if r.group.lost is not None:
            return None
        if r.chat is not None:  # an agent's messages and tools, through the chat template
            try:
                messages, tools = r.chat.chat_for(getattr(self.policy, "tokenizer", None))
            except RequestError as refusal:  # tools its template cannot show: a 400
                self._refuse(r, refusal)
                return None
            try:
                encoded = encode_prompt(self.policy, messages, tools, r.prior)
            except Exception as exc:  # e.g. roles a template refuses: this group alone is lost
                self._lose_now(r.group, f"the chat template refused the agent's call: {exc}")
                return None
            refusal = r.chat.context_error(len(encoded.ids), self.policy)
            if refusal is not None:  # answered with OpenAI's 400; no step is recorded
                self._refuse(r, refusal)
                return None
            # A stand-in policy without a context samples what it samples: no budget asked.
            budget = None
            if getattr(self.policy, "context", None) is not None:
                budget = r.chat.reply_budget(len(encoded.ids), self.policy)
            return _Prompt(
                encoded.ids, tuple(messages), tools, encoded.text, budget, encoded.starts
            )
        messages = build_messages(
            r.group.instructions, r.history, r.observation, r.admissible, self.history_window
        )
        encoded = encode_prompt(self.policy, messages, None, r.prior)
        budget = getattr(self.policy, "prompt_budget", None)
        if budget is not None and len(encoded.ids) > budget:
            fitted = fit_messages(
                messages, lambda m: len(encode_prompt(self.policy, m).ids) <= budget
            )
            if fitted is None:
                self._cut(r, len(encoded.ids), budget)
                return None
            messages, encoded = fitted, encode_prompt(self.policy, fitted, None, r.prior)
        return _Prompt(encoded.ids, tuple(messages), None, encoded.text, None, encoded.starts)

    def _refuse(self, r: _Rollout, refusal: RequestError) -> None:
        """Answer an agent's call with `refusal` (its 400); no step is recorded."""
        r.refused = str(refusal)
        self._call(self.slots.step(r.slot, refusal), r, _Reply(r, None, None, 0))

    def _cut(self, r: _Rollout, tokens: int, budget: int) -> None:
        """End a native rollout whose current turn alone is past the prompt budget: its
        last step is truncated there (a first turn that does not fit loses the group)."""
        if not r.rows:
            self._lose_now(
                r.group,
                f"the first prompt of {r.group.env_name} is {tokens} tokens, past the policy's "
                f"prompt budget of {budget} (sampling.max_prompt_tokens, and the model's "
                "context less sampling.max_new_tokens); accepted: a larger budget",
            )
            return
        self._truncate(r)

    def _truncate(self, r: _Rollout) -> None:
        """Mark the rollout's last step truncated and end the rollout there."""
        r.group.columns[C.TRUNCATED][r.rows[-1]] = True
        r.ended, r.won = True, False
        self._settle(r)

    def _lose_now(self, group: _Group, reason: str) -> None:
        """Lose `group` from the rollout loop itself (no environment call failed)."""
        self._lose(group, reason)
        if group.outstanding == 0 and group in self._groups:
            self._groups.remove(group)
            self._lanes.append(group.lane)

    def _send(self, r: _Rollout, prompt: _Prompt, sample: Sample, version: int) -> None:
        if r.chat is not None:  # the agent gets the reply as an OpenAI chat completion
            sample = r.chat.fit(sample, self.policy)
            action = r.chat.respond(prompt.ids, sample, version, self.policy)
            answer = r.chat.answered(action, getattr(self.policy, "tokenizer", None))
        else:
            action = parse_action(sample.text, r.admissible)
            answer = {"role": "assistant", "content": sample.text}
        self._call(self.slots.step(r.slot, action), r, _Reply(r, prompt, sample, version, answer))

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
            elif reply.sample is None:
                self._refused(r, future.result())
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
        r, group, sample, prompt = reply.rollout, reply.rollout.group, reply.sample, reply.prompt
        assert sample is not None and prompt is not None and reply.answer is not None
        task = group.task
        if r.prior is not None:
            found = extends.kind(prompt.ids, r.prior.prompt, r.prior.action)
            group.drift += found == "drift"
            group.slides += found == "slide"
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
            C.PROMPT_IDS: prompt.ids,
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
        _turn_rewards(r, tr)
        r.prior = Prior(
            prompt.messages,
            prompt.tools,
            prompt.text or "",
            tuple(prompt.ids),
            tuple(sample.token_ids),
            reply.answer,
            prompt.starts,
        )
        if r.chat is None:  # the turn as its user message showed it (actors/prompts.py)
            r.history.append((user_turn(r.observation, r.admissible), sample.text))
        r.step += 1
        self._next(r, tr)

    def _refused(self, r: _Rollout, tr) -> None:
        """An agent's call past the context was answered with a 400 and recorded no step;
        the agent called again (a new chat) or stopped there (its rollout is truncated,
        envs/agent.py): its last step says so."""
        if r.rows:
            last = r.rows[-1]
            columns = r.group.columns
            columns[C.NEXT_STATE_KEY][last] = tr.next_state_key
            if tr.done or tr.truncated:
                columns[C.DONE][last], columns[C.TRUNCATED][last] = tr.done, tr.truncated
                columns[C.WON][last], columns[C.REWARD][last] = tr.won, tr.reward
                _turn_rewards(r, tr)
        elif tr.done or tr.truncated:
            self._lose_now(
                r.group, f"an agent stopped at its first call, which was refused: {r.refused}"
            )
            return
        self._next(r, tr)

    def _next(self, r: _Rollout, tr) -> None:
        """Take in the environment's answer: the rollout's next turn, or its end."""
        r.observation, r.state_key, r.admissible = tr.observation, tr.next_state_key, tr.admissible
        r.chat = getattr(tr, "chat", None)
        r.ended = tr.done or tr.truncated
        r.won = tr.won
        self._settle(r)

    def _settle(self, r: _Rollout) -> None:
        """Queue the rollout for its next reply, or hand its group back once all ended."""
        group = r.group
        if not r.ended:
            self._ready.append(r)
        elif all(x.ended for x in group.rollouts):
            self._groups.remove(group)
            self._lanes.append(group.lane)
            self._finished.append(
                GroupResult(
                    task=group.task,
                    columns=group.columns,
                    rollouts=self.group_size,
                    steps=len(group.columns[C.STEP]),
                    successes=sum(x.won for x in group.rollouts),
                    versions=set(group.columns[C.POLICY_VERSION]),
                    drift=group.drift,
                    slides=group.slides,
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


def _turn_rewards(r: _Rollout, tr) -> None:
    """An agent's per-turn rewards, known at its end, onto its steps."""
    for i, reward in zip(r.rows, getattr(tr, "turn_rewards", None) or (), strict=False):
        r.group.columns[C.REWARD][i] = reward


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
