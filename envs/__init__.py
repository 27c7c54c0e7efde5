"""Environments: the registry the actors build them from, the built-in ones, and adapters
for environments of other packages.

Every named environment is a plugin behind the entry-point group `gagpo.envs`: the
built-in ones are this distribution's own entry points (pyproject.toml), so an
environment's module is imported only when it is used, and another package registers
its own the same way (docs/environments.md, "Your own environment"). An entry point names
a class (or factory) that is either an `Environment` of this project (its `reset` takes
`task_seed`) or a Gymnasium-style text environment (`reset(seed=...)`), which
`GymAdapter` wraps. Built-in names win over other packages' entry points of the same name.

Libraries of the ecosystem are selected by a name of their family, with no glue code:
`textarena/<game>`, `gem/<env id>`, `reasoning_gym/<dataset>`, `openenv+http://HOST:PORT`,
`agent:MODULE:FUNCTION`, `agent+http`, `verifiers:<taskset>` (`FAMILIES`, matched by
prefix; each adapter imports its library only when built).

What an environment declares beyond the protocol (a step oracle, replanning, whether it
may be stepped beside other slots) is read by `capabilities_of(name)`, never by its name.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping
from functools import cache
from importlib.metadata import EntryPoint, entry_points

from gagpo.envs.agent import AgentEnv, AgentHTTPEnv, is_agent
from gagpo.envs.base import Capabilities, Environment, StepOracle, capabilities
from gagpo.envs.gem_env import GemEnv
from gagpo.envs.gym_adapter import ADAPTER_OPTIONS, GymAdapter
from gagpo.envs.openenv_env import OpenEnvHTTP
from gagpo.envs.reasoning_gym_env import ReasoningGymEnv
from gagpo.envs.textarena_env import TextArenaEnv
from gagpo.envs.verifiers_env import VerifiersEnv
from gagpo.schemas.errors import GagpoError
from gagpo.schemas.extras import require

ENTRY_POINT_GROUP = "gagpo.envs"
ENGINE_EXTRAS = ("textworld", "alfworld")

DISTRIBUTION = "gagpo"  # whose entry points are the built-in environments


class _BuiltIn(Mapping[str, type[Environment]]):
    """The built-in environments by name: this distribution's entry points of the group,
    each class imported on first use (importing the registry imports no game)."""

    @staticmethod
    @cache
    def _points() -> dict[str, EntryPoint]:
        points = {
            ep.name: ep
            for ep in entry_points(group=ENTRY_POINT_GROUP)
            if ep.dist is not None and ep.dist.name == DISTRIBUTION
        }
        if not points:
            raise GagpoError(
                f"the built-in environments are not registered (no {ENTRY_POINT_GROUP} entry "
                f"points of {DISTRIBUTION}); install the project: pip install -e ."
            )
        return points

    @staticmethod
    @cache
    def _load(name: str) -> type[Environment]:
        return _BuiltIn._points()[name].load()

    def __getitem__(self, name: str) -> type[Environment]:
        if name not in self._points():
            raise KeyError(name)
        return self._load(name)

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._points()))

    def __len__(self) -> int:
        return len(self._points())


ENVIRONMENTS: Mapping[str, type[Environment]] = _BuiltIn()

# Name prefix -> the adapter that plays what follows it (a game id, a dataset, a URL).
FAMILIES: dict[str, type] = {
    "textarena/": TextArenaEnv,
    "gem/": GemEnv,
    "reasoning_gym/": ReasoningGymEnv,
    "openenv+": OpenEnvHTTP,
    "agent:": AgentEnv,  # your own agent, in this process (envs/agent.py)
    "agent+": AgentHTTPEnv,  # agent+http: an agent in another process
    "verifiers:": VerifiersEnv,  # a verifiers v1 environment, through the agent endpoint
}
FAMILY_PATTERNS = (
    "textarena/<game>",
    "gem/<env id>",
    "reasoning_gym/<dataset>",
    "openenv+http://HOST:PORT",
    "agent:MODULE:FUNCTION",
    "agent+http",
    "verifiers:PACKAGE_OR_MODULE",
)


def plugin_environments() -> dict[str, EntryPoint]:
    """Entry points of the group `gagpo.envs` in the installed packages (not loaded)."""
    return {
        ep.name: ep
        for ep in entry_points(group=ENTRY_POINT_GROUP)
        if ep.name not in ENVIRONMENTS and (ep.dist is None or ep.dist.name != DISTRIBUTION)
    }


def environment_names() -> list[str]:
    """Every name `--env` accepts: the built-ins, the installed entry points, and the
    library families' patterns."""
    return [*sorted({*ENVIRONMENTS, *plugin_environments()}), *FAMILY_PATTERNS]


def _family(name: str) -> tuple[type, str] | None:
    """The adapter of `name`'s family and the rest of the name, or None."""
    for prefix, cls in FAMILIES.items():
        if name.startswith(prefix) and len(name) > len(prefix):
            return cls, name[len(prefix) :]
    return None


def _check_options(name: str, target: object, options: dict, skip: tuple[str, ...]) -> None:
    """A GagpoError naming the first option `target`'s constructor does not take."""
    init = target.__init__ if inspect.isclass(target) else target
    params = inspect.signature(init).parameters  # type: ignore[misc]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    accepted = [p for p in params if p not in ("self", "max_turns", *skip)] + list(skip)
    if target in FAMILIES.values():  # the first argument is the rest of the name
        accepted = accepted[1:]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise GagpoError(
            f"environment {name!r} takes no option {unknown[0]!r}; accepted: {', '.join(accepted) or 'none'}"
        )


def _load_plugin(name: str, ep: EntryPoint) -> object:
    try:
        return ep.load()
    except Exception as exc:  # a broken plugin is the user's to fix: one clear line
        raise GagpoError(
            f"environment {name!r} (entry point '{ep.value}' in group {ENTRY_POINT_GROUP}) "
            f"cannot be loaded: {type(exc).__name__}: {exc}"
        ) from None


@cache
def _plugin(name: str) -> tuple[EntryPoint, object]:
    """The entry point `name` and what it names, loaded once per process (actors build an
    environment per rollout)."""
    ep = plugin_environments().get(name)
    if ep is None:
        raise GagpoError(
            f"unknown environment {name!r}; accepted: {', '.join(environment_names())}"
        )
    return ep, _load_plugin(name, ep)


def _is_native(target: object) -> bool:
    """Whether `target` follows this project's protocol: its reset takes `task_seed`."""
    reset = getattr(target, "reset", None)
    try:
        return callable(reset) and "task_seed" in inspect.signature(reset).parameters
    except (TypeError, ValueError):
        return False


def _class_of(name: str) -> object | None:
    """What environment `name` is built from (a class, or a plugin's factory), nothing
    built; None for a name no environment has."""
    if name in ENVIRONMENTS:
        return ENVIRONMENTS[name]
    if (family := _family(name)) is not None:
        return family[0]
    if name in plugin_environments():
        return _plugin(name)[1]
    return None


def capabilities_of(name: str) -> Capabilities:
    """What environment `name` declares (base.Capabilities); nothing is built. A plugin's
    factory that is not a class declares nothing."""
    target = _class_of(name)
    return capabilities(target) if isinstance(target, type) else Capabilities()


def step_oracle(name: str) -> type[StepOracle] | None:
    """The class of environment `name` when it declares the step-oracle capability
    (base.StepOracle: the optimal moves from a state), else None; nothing is built."""
    target = _class_of(name)
    return target if isinstance(target, type) and capabilities(target).step_oracle else None  # type: ignore[return-value]


def check_env(name: str, options: dict) -> None:
    """What `make_env` checks before it builds anything, without building (no game is
    generated, no library imported): the name is known and the options are taken; an entry
    point is loaded. `gagpo run` (and its --dry-run) checks the recipe's environment so."""
    if name in ENVIRONMENTS:
        _check_options(name, ENVIRONMENTS[name], options, ())
        return
    family = _family(name)
    if family is not None:
        _check_options(name, family[0], options, ())
        if hasattr(family[0], "check"):  # agents: the function loads, the options are valid
            family[0].check(family[1], options)
        return
    ep, target = _plugin(name)
    if not callable(target):
        raise GagpoError(
            f"environment {name!r} (entry point '{ep.value}') is not a class or factory"
        )
    if is_agent(target):
        AgentEnv(target, max_turns=1, name=name, **options)
        return
    _check_options(name, target, options, () if _is_native(target) else ADAPTER_OPTIONS)


def make_env(name: str, max_turns: int, **options: object) -> Environment:
    """A fresh environment `name` that truncates episodes after `max_turns` turns;
    `options` are the environment's own keyword arguments (for a Gymnasium-style
    environment, plus the adapter's: state_key, admissible_key, won_key, expert_key,
    instructions)."""
    if name in ENVIRONMENTS:
        cls = ENVIRONMENTS[name]
        _check_options(name, cls, options, ())
        if name in ENGINE_EXTRAS:  # their engines come with an extra of the same name
            require(name, f"--env {name}")
        return cls(max_turns=max_turns, **options)  # type: ignore[call-arg]
    family = _family(name)
    if family is not None:
        cls, rest = family
        _check_options(name, cls, options, ())
        return cls(rest, max_turns=max_turns, **options)  # type: ignore[return-value]
    ep, target = _plugin(name)
    if not callable(target):
        raise GagpoError(
            f"environment {name!r} (entry point '{ep.value}') is not a class or factory"
        )
    if is_agent(target):  # an entry point naming `async def agent(client, task)`
        return AgentEnv(target, max_turns=max_turns, name=name, **options)  # type: ignore[return-value]
    if _is_native(target):
        _check_options(name, target, options, ())
        env = target(max_turns=max_turns, **options)
    else:
        _check_options(name, target, options, ADAPTER_OPTIONS)
        adapter = {k: options.pop(k) for k in ADAPTER_OPTIONS if k in options}
        try:
            inner = target(**options)
        except GagpoError:
            raise
        except Exception as exc:
            raise GagpoError(
                f"environment {name!r} (entry point '{ep.value}') failed to start: "
                f"{type(exc).__name__}: {exc}"
            ) from None
        env = GymAdapter(inner, name=name, max_turns=max_turns, **adapter)  # type: ignore[arg-type]
    return env  # type: ignore[return-value]
