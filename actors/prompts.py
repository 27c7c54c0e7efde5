"""Prompts in: the chat a policy sees at each turn (its reply is read as a command by
`gagpo.envs.parse.parse_action`).

The prompt is the environment's instructions (system), a bounded window of earlier
(observation, reply) turns, and the current observation with the admissible actions.
The dialogue history lives only in the prompt; `state_key` never includes it.
"""

from __future__ import annotations

from collections.abc import Sequence

REPLY_REQUEST = "Reply with one command."


def build_messages(
    instructions: str,
    history: Sequence[tuple[str, str]],
    observation: str,
    admissible: Sequence[str] | None,
    window: int,
) -> list[dict[str, str]]:
    """System instructions, the last `window` (observation, action) turns, then the current
    observation with the admissible actions (where the environment lists them)."""
    if window < 0:
        raise ValueError(f"history window must be >= 0, got {window}")
    messages = [{"role": "system", "content": instructions}]
    for past_observation, past_action in history[-window:] if window else ():
        messages.append({"role": "user", "content": past_observation})
        messages.append({"role": "assistant", "content": past_action})
    parts = [observation]
    if admissible:
        parts.append("Admissible actions:\n" + "\n".join(f"- {a}" for a in admissible))
    parts.append(REPLY_REQUEST)
    messages.append({"role": "user", "content": "\n\n".join(parts)})
    return messages
