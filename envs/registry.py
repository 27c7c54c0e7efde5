"""The environment registry: every name `--env` accepts, and the one way to build it.

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
prefix). Like the built-ins, each adapter module is imported only when its family is
named, and imports its library only when built: listing the names loads no adapter.

What an environment declares beyond the protocol (a step oracle, replanning, whether it
may be stepped beside other slots) is read by `capabilities_of(name)`, never by its name.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterator, Mapping
from functools import cache
from importlib.metadata import EntryPoint, entry_points

from gagpo.envs.base import Capabilities, Environment, StepOracle, capabilities
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

    def __contains__(self, name: object) -> bool:  # Mapping's would load the class
        return name in self._points()

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._points()))

    def __len__(self) -> int:
        return len(self._points())


ENVIRONMENTS: Mapping[str, type[Environment]] = _BuiltIn()

# Name prefix -> the adapter that plays what follows it (a game id, a dataset, a URL), as
# "module:class" in gagpo.envs, imported when a name of the family is used.
FAMILIES: dict[str, str] = {
    "textarena/": "textarena_env:TextArenaEnv",
    "gem/": "gem_env:GemEnv",
    "reasoning_gym/": "reasoning_gym_env:ReasoningGymEnv",
    "openenv+": "openenv_env:OpenEnvHTTP",
    "agent:": "agent:AgentEnv",  # your own agent, in this process (envs/agent.py)
    "agent+": "agent:AgentHTTPEnv",  # agent+http: an agent in another process
    "verifiers:": "verifiers_env:VerifiersEnv",  # a verifiers v1 environment, via the endpoint
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
    for prefix, where in FAMILIES.items():
        if name.startswith(prefix) and len(name) > len(prefix):
            module, attr = where.split(":")
            adapter = getattr(importlib.import_module(f"gagpo.envs.{module}"), attr)
            return adapter, name[len(prefix) :]
    return None


def _check_options(
    name: str, target: object, options: dict, skip: tuple[str, ...], family: bool = False
) -> None:
    """A GagpoError naming the first option `target`'s constructor does not take; a
    `family` adapter's first argument is the rest of the name, not an option."""
    init = target.__init__ if inspect.isclass(target) else target
    params = inspect.signature(init).parameters  # type: ignore[misc]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    accepted = [p for p in params if p not in ("self", "max_turns", *skip)] + list(skip)
    if family:
        accepted = accepted[1:]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise GagpoError(
            f"environment {name!r} takes no option {unknown[0]!r}; accepted: {', '.join(accepted) or 'none'}"
        )
    from gagpo.envs.option_types import check_option_types

    check_option_types(name, init, options)  # `sizes = 'x'`: one line, not the game's TypeError


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
        _check_options(name, family[0], options, (), family=True)
        if hasattr(family[0], "check"):  # agents: the function loads, the options are valid
            family[0].check(family[1], options)
        return
    from gagpo.envs.agent import AgentEnv, is_agent
    from gagpo.envs.gym_adapter import ADAPTER_OPTIONS

    target = _callable_plugin(name)
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
        _check_options(name, cls, options, (), family=True)
        return cls(rest, max_turns=max_turns, **options)  # type: ignore[return-value]
    return _make_plugin(name, max_turns, options)


def _callable_plugin(name: str) -> object:
    ep, target = _plugin(name)
    if not callable(target):
        raise GagpoError(
            f"environment {name!r} (entry point '{ep.value}') is not a class or factory"
        )
    return target


def _make_plugin(name: str, max_turns: int, options: dict) -> Environment:
    """Another package's environment: an agent function, an environment of this
    project's protocol, or a Gymnasium-style one wrapped in `GymAdapter`."""
    from gagpo.envs.agent import AgentEnv, is_agent
    from gagpo.envs.gym_adapter import ADAPTER_OPTIONS, GymAdapter

    target = _callable_plugin(name)
    if is_agent(target):  # an entry point naming `async def agent(client, task)`
        return AgentEnv(target, max_turns=max_turns, name=name, **options)  # type: ignore[return-value]
    if _is_native(target):
        _check_options(name, target, options, ())
        return target(max_turns=max_turns, **options)  # type: ignore[operator]
    _check_options(name, target, options, ADAPTER_OPTIONS)
    adapter = {k: options.pop(k) for k in ADAPTER_OPTIONS if k in options}
    try:
        inner = target(**options)  # type: ignore[operator]
    except GagpoError:
        raise
    except Exception as exc:
        ep = _plugin(name)[0]
        raise GagpoError(
            f"environment {name!r} (entry point '{ep.value}') failed to start: "
            f"{type(exc).__name__}: {exc}"
        ) from None
    return GymAdapter(inner, name=name, max_turns=max_turns, **adapter)  # type: ignore[arg-type]
