"""Rebuild a warm start shipped with the package (workflows/recipes/warmstarts/<recipe>/):

    python -m gagpo.workflows.ship_warmstart demo

builds the recipe's [warmstart] (or takes it from the cache, $GAGPO_CACHE/warmstart/<key>/)
and writes its policy folder, warmstart.json and a MANIFEST of sha256 sums into the source
tree's warmstarts/<recipe>/, replacing what was there. Run it after a change that moves the
recipe's cache key (workflows/warmstart.py says what the key hashes); tests/test_demo_story.py
fails until the shipped key matches the code and the recipe again.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from gagpo.schemas.errors import GagpoError
from gagpo.workflows.warmstart import (
    INFO_FILE,
    MANIFEST,
    POLICY_DIR,
    cache_key,
    manifest,
    shipped_root,
    warmstart,
)


def ship(recipe: str, *, echo=print) -> Path:
    """Build (or take from the cache) `recipe`'s warm start and write its policy, warmstart.json
    and MANIFEST into the package's warmstarts/<recipe>/, replacing what was there."""
    from gagpo.workflows.recipe import load_recipe

    cfg = load_recipe(recipe, "-").warmstart  # the store is not used: only the warm start is built
    if cfg is None:
        raise GagpoError(f"recipe {recipe!r} has no [warmstart] table; accepted: one that has")
    built = warmstart(cfg, echo=echo).parent
    target = shipped_root() / Path(recipe).stem
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(built / POLICY_DIR, target / POLICY_DIR)
    shutil.copy2(built / INFO_FILE, target / INFO_FILE)
    (target / MANIFEST).write_text(json.dumps(manifest(target), indent=1, sort_keys=True) + "\n")
    echo(f"shipped warm start: {target} (key {cache_key(cfg)})")
    return target


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        raise SystemExit("usage: python -m gagpo.workflows.ship_warmstart RECIPE  (e.g. demo)")
    try:
        ship(args[0])
    except GagpoError as exc:
        raise SystemExit(f"error: {exc}") from None


if __name__ == "__main__":
    main()
