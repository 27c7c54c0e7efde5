"""Agents written with frameworks no one here wrote, as their docs show them (issue 47):
Pydantic AI's `Agent` and the OpenAI Agents SDK's `Agent` + `Runner`, each handed the
actor's client. Each asks for `task.options["max_tokens"]` reply tokens and, with
`task.options["tools"]`, declares one tool. What each framework saw is appended to
`SEEN` (in-process agents share the test's process): (finish reason, completion tokens)
per model response, or the error it raised.
"""

from __future__ import annotations

SEEN: list[tuple] = []


def where_is_the_exit(direction: str) -> str:
    """Walk one step in a direction (up, down, left or right) and say what is there."""
    return "wall"


async def pydantic_ai_agent(client, task) -> float:
    from pydantic_ai import Agent, ModelSettings
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(task.model, provider=OpenAIProvider(openai_client=client))
    tools = [where_is_the_exit] if task.options.get("tools") else []
    agent = Agent(model, instructions="Find the exit of the maze.", tools=tools)
    try:
        result = await agent.run(
            "Where is the exit?",
            model_settings=ModelSettings(max_tokens=task.options["max_tokens"]),
        )
    except Exception as exc:
        SEEN.append(("pydantic_ai", type(exc).__name__, str(exc)))
        raise
    for message in result.all_messages():
        usage = getattr(message, "usage", None)
        if usage is not None and getattr(message, "finish_reason", None):
            SEEN.append(("pydantic_ai", message.finish_reason, usage.output_tokens))
    return 0.0


async def openai_agents_sdk_agent(client, task) -> float:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # nothing leaves the machine
    tools = [function_tool(where_is_the_exit)] if task.options.get("tools") else []
    agent = Agent(
        name="maze",
        instructions="Find the exit of the maze.",
        model=OpenAIChatCompletionsModel(model=task.model, openai_client=client),
        model_settings=ModelSettings(max_tokens=task.options["max_tokens"]),
        tools=tools,
    )
    try:
        result = await Runner.run(agent, "Where is the exit?", max_turns=2)
    except Exception as exc:
        SEEN.append(("openai_agents", type(exc).__name__, str(exc)))
        raise
    for response in result.raw_responses:
        SEEN.append(("openai_agents", "response", response.usage.output_tokens))
    return 0.0


async def budget_by_seed(client, task) -> float:
    """Two calls with the plain client, each asking `budgets[seed % 2]` tokens."""
    budget = task.options["budgets"][task.seed % 2]
    messages = [{"role": "user", "content": "go"}]
    for _ in range(2):
        reply = await client.chat.completions.create(
            model=task.model, messages=messages, max_completion_tokens=budget
        )
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        messages.append({"role": "user", "content": "go on"})
    return 0.0
