"""Agents as they come (issue 47): agents written with Pydantic AI and the OpenAI Agents SDK
get replies as long as they ask (`max_tokens`, not the native `max_new_tokens`), bounded by
the context and the actor's `sampling.max_reply_tokens`, calls of different budgets served
together (lockstep and continuous batching); tools on a chat template that renders none are
refused with a 400 naming the remedy, or written as a recorded Hermes block; a tool call's
`arguments` string nested 900 deep is a 400, never a lost group; the prompt budget defaults
from the model's context.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import polars as pl
import pytest

from gagpo.actors.actor import run_actor
from gagpo.actors.policies.base import SamplingConfig, prompt_budget
from gagpo.actors.policies.presets import load_policy
from gagpo.actors.policies.prompt_ids import render, text_ids
from gagpo.envs.endpoint import shared_endpoint
from gagpo.envs.tool_calls import with_tool_block
from gagpo.schemas import columns as C
from gagpo.schemas.errors import GagpoError
from tests.helpers import framework_agents
from tests.helpers.actors import actor_config
from tests.helpers.agents import TOOLS
from tests.helpers.steps import steps_of

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PYDANTIC = "agent:tests.helpers.framework_agents:pydantic_ai_agent"
AGENTS_SDK = "agent:tests.helpers.framework_agents:openai_agents_sdk_agent"


def config(store: Path, env: str, **overrides):
    base = dict(group_size=2, groups=2, max_turns=3, sampling={"max_new_tokens": 3})
    return actor_config(store, env, **(base | overrides))


def reply_lengths(store: Path) -> list[int]:
    return steps_of(store)[C.ACTION_IDS].list.len().to_list()


@pytest.mark.parametrize(("env", "asked"), [(PYDANTIC, 40), (AGENTS_SDK, 48)])
def test_a_framework_agent_gets_replies_as_long_as_it_asks(tmp_path: Path, env, asked):
    """The tiny policy rarely ends a reply by itself: each reply runs to the call's
    max_tokens, far past the native budget of 3 tokens (issue 47 saw 24 for 64)."""
    framework_agents.SEEN.clear()
    summary = run_actor(config(tmp_path, env, env_options={"max_tokens": asked}))
    assert summary.groups_lost == 0, framework_agents.SEEN
    lengths = reply_lengths(tmp_path)
    assert max(lengths) == asked and all(n <= asked for n in lengths)
    assert sum(n == asked for n in lengths) >= len(lengths) - 1  # the odd early EOS
    seen = [s for s in framework_agents.SEEN if s[1] not in ("response", "length", "stop")]
    assert seen == []  # no framework error (pydantic-ai: no OutputTokenLimitExceeded)
    told = [s[2] for s in framework_agents.SEEN]
    assert told and set(told) <= set(lengths)  # the usage each framework was told


def test_a_reply_is_bounded_by_the_actors_ceiling(tmp_path: Path):
    summary = run_actor(
        config(
            tmp_path,
            PYDANTIC,
            env_options={"max_tokens": 40},
            sampling={"max_new_tokens": 3, "max_reply_tokens": 10},
        )
    )
    assert summary.groups_lost == 0
    assert max(reply_lengths(tmp_path)) == 10


def test_calls_of_different_budgets_share_a_lockstep_batch(tmp_path: Path):
    """Two groups in flight, asking 12 and 30 tokens: one `generate` call a round."""
    summary = run_actor(
        config(
            tmp_path,
            "agent:tests.helpers.framework_agents:budget_by_seed",
            groups=2,
            groups_in_flight=2,
            env_options={"budgets": [12, 30]},
        )
    )
    assert summary.groups_lost == 0
    steps = steps_of(tmp_path).with_columns(pl.col(C.ACTION_IDS).list.len().alias("n"))
    by_task = steps.group_by(C.TASK_ID).agg(pl.col("n").max())
    assert sorted(by_task["n"].to_list()) == [12, 30]


class Continuous:
    """The tiny policy behind vLLM's request interface (`submit`/`poll`): each request
    sampled alone with its own budget, one finished per poll."""

    def __init__(self, policy) -> None:
        self._policy, self.queue, self.budgets = policy, [], []

    def __getattr__(self, name):
        return getattr(self._policy, name)

    def submit(self, key, prompt, *, seed, max_tokens=None):
        self.budgets.append(max_tokens)
        self.queue.append((key, prompt, seed, max_tokens))

    def poll(self):
        if not self.queue:
            return []
        key, prompt, seed, budget = self.queue.pop(0)
        (sample,) = self._policy.generate([prompt], seed=seed, max_tokens=[budget])
        return [(key, sample)]

    def abort(self, keys):
        self.queue = [q for q in self.queue if q[0] not in keys]


def test_continuous_batching_serves_each_request_its_own_budget(tmp_path: Path):
    policy = Continuous(
        load_policy("tiny", sampling=SamplingConfig(max_new_tokens=3), device="cpu")
    )
    policy.stop_at_newline = False
    summary = run_actor(
        config(
            tmp_path,
            "agent:tests.helpers.framework_agents:budget_by_seed",
            groups=2,
            groups_in_flight=2,
            env_options={"budgets": [7, 19]},
        ),
        policy=policy,
    )
    assert summary.groups_lost == 0 and set(policy.budgets) == {7, 19}
    steps = steps_of(tmp_path).with_columns(pl.col(C.ACTION_IDS).list.len().alias("n"))
    assert sorted(steps.group_by(C.TASK_ID).agg(pl.col("n").max())["n"].to_list()) == [7, 19]


# -- tools the model can see -------------------------------------------------------------


def test_tools_on_a_template_that_renders_none_get_a_400_naming_the_remedy(tmp_path: Path, capfd):
    """tiny's template (as SmolLM2's) renders no tools: the agent's first call is refused,
    the framework raises the 400's line, and its group is lost with that line."""
    framework_agents.SEEN.clear()
    with pytest.raises(GagpoError, match="all 1 group"):
        run_actor(
            config(tmp_path, PYDANTIC, groups=1, env_options={"max_tokens": 8, "tools": True})
        )
    errors = [s for s in framework_agents.SEEN if s[0] == "pydantic_ai"]
    assert errors and all("renders no tools" in e[2] and "tool_prompt" in e[2] for e in errors)
    assert "400" in errors[0][2]
    lost = capfd.readouterr().err
    assert "renders no tools" in lost and 'tool_prompt = "hermes"' in lost


def test_the_hermes_tool_block_is_what_the_model_saw(tmp_path: Path):
    """tool_prompt = "hermes": the tools are written into the system message; the first
    step's prompt_ids are exactly the template's rendering of that chat."""
    summary = run_actor(
        config(
            tmp_path,
            "agent:tests.helpers.agents:maze",
            groups=1,
            sampling={"max_new_tokens": 3, "max_reply_tokens": 4},
            env_options={"tool_prompt": "hermes"},
        )
    )
    assert summary.groups_lost == 0
    policy = load_policy("tiny", device="cpu")
    messages = (
        {"role": "system", "content": "you are in a maze . call move with a direction ."},
        {"role": "user", "content": "find the exit . go up or down or left or right ."},
    )
    chat = with_tool_block(messages, tuple(TOOLS))
    expected = text_ids(policy.tokenizer, render(policy.tokenizer, chat, None, generation=True))
    first = steps_of(tmp_path).filter(pl.col(C.STEP) == 0)
    assert set(map(tuple, first[C.PROMPT_IDS].to_list())) == {tuple(expected)}
    assert '"name": "move"' in chat[0]["content"] and "<tool_call>" in chat[0]["content"]


# -- bounds ------------------------------------------------------------------------------


def test_a_tool_call_arguments_string_nested_900_deep_is_a_400():
    """Issue 46: the string passed the body's depth bound and lost the group with a 409."""
    endpoint = shared_endpoint()
    rollout = endpoint.open(model="policy")
    deep = "[" * 900 + "]" * 900
    body = {
        "model": "policy",
        "messages": [
            {"role": "user", "content": "go"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c", "function": {"name": "move", "arguments": deep}}],
            },
            {"role": "tool", "tool_call_id": "c", "content": "wall"},
        ],
    }
    try:
        status, payload = asyncio.run(endpoint.chat(rollout.token, json.dumps(body).encode()))
    finally:
        endpoint.close(rollout, "the test ended")
    assert status == 400
    line = payload["error"]["message"]
    assert "arguments nest deeper than 64 levels" in line and "\n" not in line
    assert rollout.events.empty()  # nothing reached the rollout loop


def test_the_prompt_budget_defaults_from_the_models_context():
    policy = load_policy("tiny", sampling=SamplingConfig(max_new_tokens=24), device="cpu")
    assert policy.context == 2048 and policy.prompt_budget == 2048 - 24
    assert SamplingConfig().max_prompt_tokens is None
    assert prompt_budget(SamplingConfig(max_prompt_tokens=100), 2048) == 100
    assert prompt_budget(SamplingConfig(max_prompt_tokens=4000), 2048) == 2048 - 24
