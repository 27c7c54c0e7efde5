"""Demonstrations: the environment's expert plays, the policy only tokenizes.

`gagpo-actors --expert [--expert-noise p]` runs the ordinary actor loop with an `Expert`
in place of the policy's sampler (actors/rollout.py `demonstrator`). The prompts are
built and encoded by the policy exactly as in RL, and each expert reply is encoded with
the policy's tokenizer and closed with its end-of-turn token, the way the policy itself
would end it; so supervised fine-tuning (`gagpo-learner --mode sft`) trains on the very
token sequences RL samples from. Shards are ordinary grouped shards, marked in their file
metadata as demonstrations (`gagpo.source = demonstration`).

`behavior_logprobs` of a demonstration are zeros (log 1: the expert chose its tokens
deterministically); the supervised loss does not read them. They are not a sampling
distribution, so demonstration shards are for `--mode sft`, not for the RL objective.

Noise: with probability p a turn plays a uniformly random admissible command instead of
the expert's; at the next turn the expert replans from the state reached where the
environment offers `replan()` (sokoban, household), and otherwise continues its plan.
An admissible entry with a `<placeholder>` is a template, not a command (WebShop's search
page lists `search[<your query>]`): noise never plays one, and a turn whose list holds only
templates follows the plan (played literally, a template would teach a warm-started
policy to search for "<your query>").
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from gagpo.actors.policies.base import Sample
from gagpo.envs.base import Environment, Replanner
from gagpo.schemas import columns as C

META_SOURCE = C.META_SOURCE
DEMONSTRATION = b"demonstration"
DEMO_METADATA = {META_SOURCE: DEMONSTRATION}
FALLBACK_COMMAND = "look"  # played when the plan ran out and no admissible list exists
_TEMPLATE = re.compile(r"<[^<>]+>")  # a placeholder to fill: `search[<your query>]`


def playable(admissible: tuple[str, ...] | None) -> list[str]:
    """The admissible commands that are commands, not templates with a placeholder."""
    return [a for a in admissible or () if not _TEMPLATE.search(a)]


def encode_reply(policy, text: str) -> list[int]:
    """`text` as the policy would emit it: its tokens, then the end-of-turn (EOS) token."""
    ids = policy.tokenizer(text, add_special_tokens=False)["input_ids"]
    return [int(i) for i in ids] + [int(policy.eos_ids[0])]


@dataclass
class _Plan:
    commands: list[str]
    replan_due: bool = False


@dataclass
class Expert:
    """A demonstrator for one group: `Expert(policy, noise, rng)(envs, admissible) -> samples`.

    Plans are held per environment instance, so make one Expert per group."""

    policy: object
    noise: float = 0.0
    rng: random.Random = field(default_factory=random.Random)
    _plans: dict[int, _Plan] = field(default_factory=dict, init=False, repr=False)

    def choose(self, env: Environment, admissible: tuple[str, ...] | None) -> str:
        plan = self._plans.get(id(env))
        if plan is None:  # first turn: the environment was just reset
            plan = self._plans[id(env)] = _Plan(list(env.expert_plan() or []))
        if plan.replan_due:
            # A worker process's proxy forwards the call; an environment without the
            # capability answers None there.
            fresh = env.replan() if isinstance(env, Replanner) else None
            if fresh is not None:
                plan.commands = list(fresh)
            plan.replan_due = False
        commands = playable(admissible)
        if commands and self.noise > 0 and self.rng.random() < self.noise:
            plan.replan_due = True
            return self.rng.choice(commands)
        if plan.commands:
            return plan.commands.pop(0)
        return self.rng.choice(commands) if commands else FALLBACK_COMMAND

    def __call__(
        self, envs: list[Environment], admissible: list[tuple[str, ...] | None]
    ) -> list[Sample]:
        samples = []
        for env, allowed in zip(envs, admissible, strict=True):
            text = self.choose(env, allowed)
            ids = encode_reply(self.policy, text)
            samples.append(Sample(text=text, token_ids=ids, logprobs=[0.0] * len(ids)))
        return samples
