"""Built-in environments and the registry the actors build them from.

To add an environment, import its class here and add it to `ENVIRONMENTS` under its
`name`; keep heavy third-party imports inside that environment's methods, so that
importing the registry stays fast and works without the optional extras.
"""

from __future__ import annotations

from gagpo.actors.envs.alfworld_env import ALFWorld
from gagpo.actors.envs.base import Environment
from gagpo.actors.envs.household import Household
from gagpo.actors.envs.sokoban import Sokoban
from gagpo.actors.envs.textworld_env import TextWorld
from gagpo.schemas.errors import GagpoError

ENVIRONMENTS: dict[str, type[Environment]] = {
    ALFWorld.name: ALFWorld,
    Household.name: Household,
    Sokoban.name: Sokoban,
    TextWorld.name: TextWorld,
}


def make_env(name: str, max_turns: int) -> Environment:
    """A fresh environment `name` that truncates episodes after `max_turns` turns."""
    try:
        cls = ENVIRONMENTS[name]
    except KeyError:
        accepted = ", ".join(sorted(ENVIRONMENTS))
        raise GagpoError(f"unknown environment {name!r}; accepted: {accepted}") from None
    return cls(max_turns=max_turns)  # type: ignore[call-arg]
