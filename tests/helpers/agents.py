"""Agents written only against the `openai` package (tests/test_agent_endpoint.py plays them
with `--env agent:tests.helpers.agents:<name>`).

`maze` is the docs' example in spirit: a multi-turn agent with one tool, `move`. The tiny
policy writes words, not tool calls, so a reply without one is read as the direction
(`move` called by the agent itself); a policy that writes the template's tool calls gets
them executed as OpenAI's tool messages.
"""

from __future__ import annotations

import asyncio
import json
import random

DIRECTIONS = ["up", "down", "left", "right"]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "move",
            "description": "Move one step in a direction.",
            "parameters": {
                "type": "object",
                "required": ["direction"],
                "properties": {"direction": {"type": "string", "enum": DIRECTIONS}},
            },
        },
    }
]
TURNS = 3


async def maze(client, task):
    """Find the exit's direction in TURNS tries: reward 1 and won when found."""
    exit_ = random.Random(task.seed).choice(DIRECTIONS)
    messages = [
        {"role": "system", "content": "you are in a maze . call move with a direction ."},
        {"role": "user", "content": f"find the exit . go {' or '.join(DIRECTIONS)} ."},
    ]
    for _ in range(TURNS):
        reply = await client.chat.completions.create(
            model=task.model, messages=messages, tools=TOOLS
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if message.tool_calls:
            found = False
            for call in message.tool_calls:
                direction = json.loads(call.function.arguments).get("direction")
                found = found or direction == exit_
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": call.id,
                        "content": "exit" if direction == exit_ else "wall",
                    }
                )
        else:
            words = (message.content or "").split()
            found = exit_ in words[:1]
            messages.append({"role": "user", "content": "exit" if found else "wall . go on ."})
        if found:
            return {"reward": 1.0, "won": True}
    return 0.0


async def named_states(client, task):
    """Names its own state keys: the turn index (`extra_body`)."""
    messages = [{"role": "user", "content": "go up or down ."}]
    for turn in range(2):
        reply = await client.chat.completions.create(
            model=task.model, messages=messages, extra_body={"gagpo": {"state_key": f"turn={turn}"}}
        )
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "user", "content": "go on ."},
        ]
    return {"reward": 0.5, "won": False, "turn_rewards": [0.25, 0.0]}


async def raises(client, task):
    """Raises after its first call on task seed 13."""
    await client.chat.completions.create(
        model=task.model, messages=[{"role": "user", "content": "up"}]
    )
    if task.seed == 13:
        raise ValueError("the agent's own bug")
    return 1.0


async def hangs(client, task):
    """Never calls again after its first reply on task seed 13."""
    await client.chat.completions.create(
        model=task.model, messages=[{"role": "user", "content": "up"}]
    )
    if task.seed == 13:
        await asyncio.sleep(3600)
    return 1.0


async def malformed(client, task):
    """Sends a message without a role on task seed 13 (the openai client raises its 400)."""
    messages = [{"role": "user", "content": "up"}]
    await client.chat.completions.create(model=task.model, messages=messages)
    if task.seed == 13:
        messages.append({"content": "no role"})
    await client.chat.completions.create(model=task.model, messages=messages)
    return 1.0


async def wrong_model(client, task):
    """Calls a model the actor does not serve on task seed 13."""
    await client.chat.completions.create(
        model=task.model, messages=[{"role": "user", "content": "up"}]
    )
    model = "gpt-4o" if task.seed == 13 else task.model
    await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "up"}])
    return 1.0
