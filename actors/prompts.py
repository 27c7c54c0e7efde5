"""Prompts in: the chat a policy sees at each turn (its reply is read as a command by
`gagpo.envs.parse.parse_action`).

The prompt is the environment's instructions (system), a bounded window of earlier
turns, and the current observation with the admissible actions. An earlier turn is shown
as it was when it was current (the rollout loop keeps the user message it showed), so a
window that holds the whole episode makes each prompt the previous one continued, and
its ids the previous prompt and reply ids extended (actors/policies/prompt_ids.py).
The dialogue history lives only in the prompt; `state_key` never includes it.

A prompt past the policy's context never loses its system prompt or current turn (where
every environment restates its task): whole oldest turns are dropped, never part of one
(`fit_messages`), and a rollout whose current turn alone does not fit ends truncated.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLY_REQUEST = "Reply with one command."


def user_turn(observation: str, admissible: Sequence[str] | None) -> str:
    """The user message of a turn: the observation, the admissible actions (where the
    environment lists them), and the request for one command."""
    parts = [observation]
    if admissible:
        parts.append("Admissible actions:\n" + "\n".join(f"- {a}" for a in admissible))
    parts.append(REPLY_REQUEST)
    return "\n\n".join(parts)


def build_messages(
    instructions: str,
    history: Sequence[tuple[str, str]],
    observation: str,
    admissible: Sequence[str] | None,
    window: int,
) -> list[dict[str, str]]:
    """System instructions, the last `window` (user message, reply) turns as given, then
    the current observation's user message (`user_turn`)."""
    if window < 0:
        raise ValueError(f"history window must be >= 0, got {window}")
    messages = [{"role": "system", "content": instructions}]
    for past_user, past_action in history[-window:] if window else ():
        messages.append({"role": "user", "content": past_user})
        messages.append({"role": "assistant", "content": past_action})
    messages.append({"role": "user", "content": user_turn(observation, admissible)})
    return messages


def fit_messages(
    messages: list[dict[str, str]], fits: Callable[[list[dict[str, str]]], bool]
) -> list[dict[str, str]] | None:
    """`messages` (system, earlier turns as user/assistant pairs, current user message)
    with the fewest whole oldest turns dropped for which `fits`; None when the system
    prompt and the current message alone do not fit. Dropping more turns never makes a
    prompt longer, so the count is found by bisection (a few encodings, not one a turn)."""
    system, turns, current = messages[:1], messages[1:-1], messages[-1:]

    def kept(dropped: int) -> list[dict[str, str]]:
        return system + turns[2 * dropped :] + current

    n = len(turns) // 2
    if fits(kept(0)):
        return kept(0)
    if not fits(kept(n)):
        return None
    low, high = 0, n  # kept(low) does not fit, kept(high) does
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if fits(kept(middle)) else (middle, high)
    return kept(high)
