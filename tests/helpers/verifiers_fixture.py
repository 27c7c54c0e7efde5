"""A verifiers v1 environment written the verifiers way (tests/test_verifiers_env.py plays it
with `--env verifiers:tests.helpers.verifiers_fixture`).

A number game: the task's prompt asks for a digit; the environment's `run()` plays the
user, answering each reply with "higher", "lower" or "right" for up to `TURNS` turns,
as verifiers' TextArena environment steps its game engine. The reward is the task's
`@vf.reward` methods over the finished trace: verifiers' own scoring.
"""

from __future__ import annotations

import re

import verifiers.v1 as vf

TURNS = 3
SIZE = 12


def guesses(trace) -> list[int | None]:
    """The digit each assistant reply names first (None: no digit)."""
    found = []
    for message in trace.assistant_messages:
        match = re.search(r"\d+", message.content or "")
        found.append(int(match.group()) if match else None)
    return found


class NumberData(vf.TaskData):
    secret: int


class NumberTask(vf.Task[NumberData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def found(self, task, trace) -> float:
        return 1.0 if task.secret in guesses(trace) else 0.0

    @vf.reward(weight=0.1)
    async def brief(self, trace) -> float:
        """A small shaping term: the share of replies of at most 16 characters."""
        replies = trace.assistant_messages
        return sum(len(m.content or "") <= 16 for m in replies) / max(1, len(replies))

    @vf.metric
    async def turns(self, trace) -> float:
        return float(len(trace.assistant_messages))


class NumberConfig(vf.TasksetConfig):
    fail_on: int | None = None
    """The task index whose episode raises (a broken environment, for the tests)."""


class NumberTaskset(vf.Taskset[NumberTask, NumberConfig]):
    def load(self):
        for i in range(SIZE):
            yield NumberTask(
                NumberData(
                    name=f"number#{i}",
                    prompt=f"guess my number between 0 and 9 . say one number . ({i})",
                    system_prompt="you play a guessing game .",
                    secret=(7 * i + 3) % 10,
                ),
                self.config.task,
            )


class NumberEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


class NumberEnv(vf.Env[NumberEnvConfig]):
    async def run(self, task, agents):
        secret = task.data.secret
        if task.data.idx == self.taskset.config.fail_on:
            raise RuntimeError(f"the environment's own bug on task {task.data.idx}")
        async with agents.player.interaction(task) as interaction:
            segment = await interaction.turn()  # the prompted task speaks first
            for _ in range(TURNS - 1):
                if segment.terminated:
                    break
                guess = guesses(interaction.trace)[-1]
                if guess == secret:
                    break
                hint = (
                    "no number . say one"
                    if guess is None
                    else "higher"
                    if guess < secret
                    else "lower"
                )
                segment = await interaction.turn(hint)


__all__ = ["NumberEnv", "NumberTaskset"]
