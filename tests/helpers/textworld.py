"""TextWorld for the tests: skip without it, and users' own games made with tw-make."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gagpo.schemas.cache import cache_root


def needs_textworld() -> None:
    pytest.importorskip(
        "textworld", reason="textworld is not installed (see INSTALL-NOTES-envs.md)"
    )


# name -> tw-make arguments. "custom-3" names its objects "type X latchkey", "type X box".
TW_MAKE = {
    "custom-3": [
        "custom",
        "--world-size",
        "3",
        "--nb-objects",
        "6",
        "--quest-length",
        "3",
        "--theme",
        "house",
        "--seed",
        "3",
    ],
    "treasure-2": ["tw-treasure_hunter", "--level", "1", "--seed", "2"],
    "coin-1": ["tw-coin_collector", "--level", "1", "--seed", "1"],
    # multi-room cooking: TextWorld's walkthrough opens the fridge twice
    "cooking-go9-1": [
        "tw-cooking",
        "--recipe",
        "3",
        "--take",
        "2",
        "--open",
        "--go",
        "9",
        "--seed",
        "1",
    ],
}


def tw_make(name: str) -> Path:
    """Game `name` of TW_MAKE made by the tw-make CLI, kept in the test cache."""
    needs_textworld()
    folder = cache_root() / "tests" / "tw-make"
    game = folder / f"{name}.z8"
    if not (game.is_file() and game.with_suffix(".json").is_file()):
        folder.mkdir(parents=True, exist_ok=True)
        tw_make_cli = Path(sys.executable).parent / "tw-make"
        done = subprocess.run(
            [str(tw_make_cli), *TW_MAKE[name], "--output", str(game), "-f"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
    return game
