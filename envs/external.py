"""Helpers shared by the environments that drive third-party engines (TextWorld, ALFWorld).

Those engines are optional registry packages: they are imported inside the
environments' methods, and a missing one is a `GagpoError` that names the pip command.
Generated games are cached on disk and written atomically, so actors that build the
same game at once never read a half-written file.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from gagpo.envs.base import Transition
from gagpo.envs.parse import normalise_command
from gagpo.schemas.errors import GagpoError
from gagpo.storage.files import atomic_write

# What `make install` runs for the optional engines (INSTALL-NOTES-envs.md has the why).
PIP_TEXTWORLD = (
    "make install, or: pip install --no-deps textworld==1.7.0 jericho==3.3.1 && pip install "
    "tatsu==5.8.3 hashids mementos termcolor prompt_toolkit more-itertools"
)
PIP_ALFWORLD = (
    f"{PIP_TEXTWORLD} && PATH=$VIRTUAL_ENV/bin:$PATH pip install fast-downward-textworld==20.6.4"
    " && pip install --no-deps alfworld==0.4.2"
)
_ARTICLES = frozenset({"the", "a", "an"})


def require(module: str, pip_command: str) -> ModuleType:
    """Import `module`, or raise a GagpoError that says how to install it. A library that is
    installed but fails to import (a version written for another Python: a SyntaxError in
    its code) is one line too."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise GagpoError(
            f"this environment needs the Python module '{module}' ({exc}); install it with: "
            f"{pip_command}"
        ) from None
    except (Exception, SystemExit) as exc:
        where = f" ({exc.filename}, line {exc.lineno})" if isinstance(exc, SyntaxError) else ""
        first = (str(getattr(exc, "msg", None) or exc).strip().splitlines() or [""])[0][:200]
        raise GagpoError(
            f"the Python module '{module}' is installed but fails to import under Python "
            f"{sys.version_info.major}.{sys.version_info.minor}: {type(exc).__name__}: {first}"
            f"{where}; accepted: a version of '{module}' that imports under this Python "
            f"(the adapter targets: {pip_command})"
        ) from None


def write_json_atomic(path: Path, data: Any) -> None:
    """`data` as JSON at `path`, whole or not at all (schemas.files.atomic_write)."""
    atomic_write(path, lambda temp: temp.write_text(json.dumps(data)))


def _bare(command: str) -> str:
    return " ".join(w for w in command.split() if w not in _ARTICLES)


def match_command(reply: str, admissible: tuple[str, ...]) -> str | None:
    """The admissible command a reply names, or None. Decoration, case and articles are
    ignored in the comparison; what comes back is the command in the game's own spelling
    ("unlock chest with type X latchkey"), which engines that parse case need."""
    command = normalise_command(reply)  # lower-case
    exact: dict[str, str] = {}
    bare: dict[str, str] = {}
    for a in admissible:
        spelled = " ".join(a.lower().split())
        exact.setdefault(spelled, a)
        bare.setdefault(_bare(spelled), a)
    return exact.get(command) or bare.get(_bare(command))


def clean_feedback(text: str) -> str:
    """Engine output without prompt lines ("> ..."), trailing blanks or runs of empty lines."""
    lines: list[str] = []
    for raw in text.splitlines():
        line = raw.rstrip()
        if line.lstrip().startswith(">"):
            continue
        if not line.strip() and (not lines or not lines[-1]):
            continue
        lines.append(line.strip())
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)


def end_turn(
    env: Any,
    *,
    observation: str,
    before: str,
    reward: float,
    done: bool,
    valid: bool,
    won: bool = False,
) -> Transition:
    """The transition of a turn of an engine-backed environment (textworld, alfworld):
    truncation at the turn limit, no next state or admissible actions after a terminal.
    `won`: the game reports its task accomplished (a lost game is done, not won). The
    environment's `_task` sentence (None: none) ends every observation but the last."""
    truncated = not done and env._turn >= env.max_turns
    env._over = done or truncated
    if env._task and not done:  # restated every turn: the prompt keeps few earlier turns
        observation += f"\n\n{env._task}"
    return Transition(
        observation=observation,
        state_key=before,
        next_state_key=None if done else env._state_key,
        reward=reward,
        done=done,
        truncated=truncated,
        action_valid=valid,
        admissible=() if done else env._admissible,
        won=won and done,
    )
