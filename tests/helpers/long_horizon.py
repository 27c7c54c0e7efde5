"""A long-horizon task for tests and the learner's benchmark (issue 38).

`corridor` is an agent written only against the `openai` package that keeps its whole
history and plays up to `task.max_turns` turns (20–50 in the tests): it walks a corridor
toward an exit it is told about each turn. Played with
`--env agent:tests.helpers.long_horizon:corridor`. Its `task.options` (the actor's
`env_options`) change how it treats its history:

- `edit_every = k`: every k-th turn it rewrites its previous reply before sending the
  history back (the prompt then cannot extend the previous one: a break);
- `grow = n`: every user turn carries n extra words, so a long conversation passes the
  context; the agent stops at the endpoint's `context_length_exceeded` (it returns
  `{"truncated": True}` when `on_context = "return"`, or lets the error propagate).

`CorridorEnv` is the same task as a native environment (its observation restates the
task every turn, as the built-in ones do; `grow` words more each turn), for a native run
with a history window that holds the whole episode. Each `openai.BadRequestError` an
agent met is appended to `CONTEXT_ERRORS` (in-process agents share the test's process).

The steps of such rollouts without a model (each prompt the previous prompt + its reply +
the new user turn), for the learner's tests and benchmark: tests/helpers/history.py.
"""

from __future__ import annotations

import random

from gagpo.envs.base import Reset, Transition

SYSTEM = "you are in a corridor . reply with one direction : left or right ."
LENGTH = 9  # cells; the agent starts in the middle
# (status, code, param, calls answered before it) of each BadRequestError an agent met.
CONTEXT_ERRORS: list[tuple[int, str | None, str | None, int]] = []


async def corridor(client, task):
    """Walk toward the exit; reward 1 and won on reaching it, else 0 after max_turns."""
    import openai

    options = task.options
    edit_every, grow = int(options.get("edit_every", 0)), int(options.get("grow", 0))
    exit_ = random.Random(task.seed).choice([0, LENGTH - 1])
    position = LENGTH // 2
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": _where(position, exit_, grow, 0)},
    ]
    for turn in range(task.max_turns):
        if edit_every and turn and turn % edit_every == 0:
            messages[-2] = {"role": "assistant", "content": "right"}  # its own history, edited
        try:
            reply = await client.chat.completions.create(model=task.model, messages=messages)
        except openai.BadRequestError as exc:
            CONTEXT_ERRORS.append((exc.status_code, exc.code, exc.param, turn))
            if options.get("on_context") == "return" and exc.code == "context_length_exceeded":
                return {"truncated": True}
            raise
        content = reply.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": content})
        words = content.split()
        step = {"left": -1, "right": 1}.get(words[0] if words else "", 0)
        position = min(max(position + step, 0), LENGTH - 1)
        if position == exit_:
            return {"reward": 1.0, "won": True}
        messages.append({"role": "user", "content": _where(position, exit_, grow, turn + 1)})
    return 0.0


def _where(position: int, exit_: int, grow: int, turn: int) -> str:
    side = "left" if exit_ < position else "right"
    padding = " ." * grow
    return f"turn {turn} . you are at {position} . the exit is to the {side} .{padding}"


class CorridorEnv:
    """`corridor` as a native environment: reply left or right; the exit ends it (won)."""

    name = "corridor"
    instructions = SYSTEM
    thread_safe = True

    def __init__(self, max_turns: int = 30, grow: int = 0) -> None:
        self.max_turns, self.grow = max_turns, grow

    def reset(self, task_seed: int) -> Reset:
        self.exit = random.Random(task_seed).choice([0, LENGTH - 1])
        self.position, self.turn = LENGTH // 2, 0
        return Reset(self._observation(), self._key(), ("left", "right"))

    def step(self, reply: str) -> Transition:
        before = self._key()
        step = {"left": -1, "right": 1}.get(reply.strip(), 0)
        self.position = min(max(self.position + step, 0), LENGTH - 1)
        self.turn += 1
        won = self.position == self.exit
        cut = not won and self.turn >= self.max_turns
        return Transition(
            observation=self._observation(),
            state_key=before,
            next_state_key=None if won else self._key(),
            reward=float(won),
            done=won,
            truncated=cut,
            action_valid=step != 0,
            admissible=("left", "right"),
            won=won,
        )

    def _observation(self) -> str:
        return _where(self.position, self.exit, self.grow * (self.turn + 1), self.turn)

    def _key(self) -> str:
        return f"corridor:{self.exit}:{self.position}"

    def expert_plan(self) -> list[str] | None:
        return None

    @classmethod
    def vocabulary(cls) -> list[str]:
        return []
