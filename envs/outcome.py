"""What an agent's rollout ends with: its outcome, read and checked (`read_outcome`), or
the failure that loses it (`AgentError`). Shared by the agent environments (envs/agent.py)
and the endpoint's agent+http `end` (envs/endpoint.py), which import it, not each other."""

from __future__ import annotations

import math
import struct


class AgentError(RuntimeError):
    """The agent failed its rollout (raised, returned no reward, never called the model)."""


def read_outcome(result: object, turns: int) -> tuple[list[float], bool, bool]:
    """The rewards of a rollout's `turns` turns, whether it was won and whether it was cut
    (not ended), from what the agent returned: a number (the last turn's reward; won when
    positive), or a dict with `reward` (added to the last turn), `won`, `turn_rewards` (one
    per turn) and `truncated` (the agent stopped at a limit of its own: never won)."""
    accepted = (
        "accepted: a number, or a dict with reward (number), won (bool), truncated (bool), "
        "turn_rewards (list of numbers, one per call)"
    )
    truncated = False
    if _is_number(result):
        reward, won, per_turn = float(result), float(result) > 0, [0.0] * turns  # type: ignore[arg-type]
    elif isinstance(result, dict):
        reward, truncated = result.get("reward", 0.0), result.get("truncated", False)
        won, per_turn = result.get("won", False), result.get("turn_rewards", [0.0] * turns)
        if not _is_number(reward) or not isinstance(won, bool) or not isinstance(truncated, bool):
            raise AgentError(f"agent returned {_short(result)}; {accepted}")
        if won and truncated:
            raise AgentError(f"agent returned won and truncated; {accepted}")
        if not isinstance(per_turn, list | tuple) or not all(_is_number(x) for x in per_turn):
            raise AgentError(f"agent returned turn_rewards {_short(per_turn)}; {accepted}")
        if len(per_turn) != turns:
            raise AgentError(
                f"agent returned {len(per_turn)} turn_rewards for {turns} calls; {accepted}"
            )
        reward, per_turn = float(reward), [float(x) for x in per_turn]
    else:
        raise AgentError(f"agent returned {_short(result)}; {accepted}")
    rewards = [*per_turn[:-1], per_turn[-1] + reward]
    if not all(_is_float32(x) for x in rewards):  # rewards are stored as float32
        raise AgentError(
            f"agent returned a reward that is not finite as a float32 ({_short(result)}); "
            "accepted: |reward| <= 3.4e38"
        )
    return rewards, won, truncated


def _is_float32(x: float) -> bool:
    """Finite, and still finite once rounded to float32 (the steps table's reward type)."""
    try:
        struct.pack("<f", x)
    except OverflowError:
        return False
    return math.isfinite(x)


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _short(x: object) -> str:
    text = repr(x)
    return text if len(text) <= 120 else text[:117] + "..."
