"""Optional dependencies, grouped as the package's extras (pyproject.toml).

The core (schemas, pipeline, SQL) needs no torch. Everything heavier sits behind an
extra; a command that needs one checks for it first, so a missing package is one line
naming the extra to install rather than an ImportError deep inside a stage.
"""

from __future__ import annotations

import importlib.util

from gagpo.schemas.errors import GagpoError

# extra -> the importable modules it provides (the ones our code imports).
EXTRAS: dict[str, tuple[str, ...]] = {
    "learner": ("torch", "transformers", "safetensors", "zarr"),
    "actors": ("torch", "transformers", "safetensors"),
    "s3": ("s3fs",),
    "report": ("matplotlib", "zarr"),
    "textworld": ("textworld",),
    "alfworld": ("alfworld", "textworld"),
    "vllm": ("vllm",),
    "lora": ("peft",),
    "view": ("starlette", "uvicorn"),
    "agent": ("openai", "starlette", "uvicorn"),
    "verifiers": ("verifiers",),
}


class MissingExtra(GagpoError):
    """An optional dependency is not installed; the message names the extra."""


def missing(extra: str) -> list[str]:
    """The modules of `extra` that cannot be imported here (checked without importing)."""
    return [m for m in EXTRAS[extra] if importlib.util.find_spec(m) is None]


def require(extra: str, purpose: str) -> None:
    """Raise `MissingExtra` (one line) unless every module of `extra` is installed."""
    absent = missing(extra)
    if absent:
        raise MissingExtra(
            f"{purpose} needs the '{extra}' extra ({', '.join(absent)} not installed): "
            f"pip install 'gagpo[{extra}]'"
        )
