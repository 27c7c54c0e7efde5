"""The layering of docs/design.md §2, read from the source: every import of every module,
lazy ones (inside functions, under TYPE_CHECKING) included.

    schemas     imports nothing of ours (the contracts)
    storage     imports schemas; never a config model, click or pydantic (the engine)
    envs        imports schemas and storage (environments, adapters, the agent endpoint)
    actors      imports schemas, storage and envs
    pipeline    imports schemas and storage; never torch (the advantage stage)
    inspection  imports schemas, storage and pipeline; never torch (SQL, report, view)
    learner     imports schemas, storage and pipeline; never actors, never inspection
    workflows   imports all
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.helpers.tree import LAYERS

ROOT = Path(__file__).resolve().parents[1]
# The layers of ours each layer may import (itself always), and outside packages it may not.
ALLOWED = {
    "schemas": set(),
    "storage": {"schemas"},
    "envs": {"schemas", "storage"},
    "actors": {"schemas", "storage", "envs"},
    "pipeline": {"schemas", "storage"},
    "inspection": {"schemas", "storage", "pipeline"},
    "learner": {"schemas", "storage", "pipeline"},
    "workflows": {"schemas", "storage", "envs", "actors", "pipeline", "inspection", "learner"},
}
# Outside packages, and modules of ours, a layer may not import even where its layer may.
FORBIDDEN_PACKAGES = {
    "storage": {"click", "pydantic", "torch"},
    "pipeline": {"torch"},
    "inspection": {"torch"},
}
FORBIDDEN_MODULES = {
    # The storage engine takes plain arguments: no config model, no CLI plumbing.
    "storage": {
        "gagpo.schemas.config",
        "gagpo.schemas.cli",
        "gagpo.schemas.cli_models",
        "gagpo.schemas.overrides",
    },
}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in `path`, at any depth."""
    package = "gagpo." + ".".join(path.relative_to(ROOT).parent.parts)
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            if node.module is None or node.level:  # `from . import x`: x may be a module
                found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


def layer_of(module: str) -> str | None:
    """Our layer a module name belongs to (gagpo.<layer>…), or None for outside code."""
    parts = module.split(".")
    if parts[0] == "gagpo" and len(parts) > 1 and parts[1] in LAYERS:
        return parts[1]
    return None


def violations(layer: str) -> list[str]:
    out = []
    for path in sorted((ROOT / layer).rglob("*.py")):
        for line, module in imported_modules(path):
            target = layer_of(module)
            top = module.split(".")[0]
            if target is not None and target != layer and target not in ALLOWED[layer]:
                out.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
            if top in FORBIDDEN_PACKAGES.get(layer, ()):
                out.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
            if any(
                module == banned or module.startswith(banned + ".")
                for banned in FORBIDDEN_MODULES.get(layer, ())
            ):
                out.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
            if top in LAYERS:  # a bare `schemas`: only works from a checkout, never installed
                out.append(f"{path.relative_to(ROOT)}:{line} imports {module} (not gagpo.{module})")
    return out


@pytest.mark.parametrize("layer", LAYERS)
def test_imports_follow_the_layering(layer):
    assert violations(layer) == []


def test_the_reader_sees_lazy_and_relative_imports(tmp_path, monkeypatch):
    """The check itself: an import inside a function, under TYPE_CHECKING or relative is found."""
    folder = tmp_path / "pipeline"
    folder.mkdir()
    (folder / "bad.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from gagpo.actors import actor\n"
        "def f():\n    import torch\n    from ..learner import train\n"
    )
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    assert violations("pipeline") == [
        "pipeline/bad.py:3 imports gagpo.actors",
        "pipeline/bad.py:5 imports torch",
        "pipeline/bad.py:6 imports gagpo.learner",
        "pipeline/bad.py:6 imports gagpo.learner.train",
    ]


# --- cycles: no two of our modules import each other, directly or round a loop --------
# Pending an edit outside this change: vllm_backend.py still imports check_model_dir and
# quiet_transformers from presets.py (they live in folders.py now). Remove once it does.
KNOWN_CYCLES: list[set[str]] = []


def module_files() -> dict[str, Path]:
    files = {}
    for layer in LAYERS:
        for path in (ROOT / layer).rglob("*.py"):
            parts = ["gagpo", *path.relative_to(ROOT).with_suffix("").parts]
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def import_graph() -> dict[str, set[str]]:
    """Our module → our modules it imports. `from pkg import mod` points at pkg.mod, not at
    the package's __init__ (which only re-exports)."""
    files = module_files()
    graph = {}
    for name, path in files.items():
        targets = set()
        for _, module in imported_modules(path):
            if module in files:
                targets.add(module)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                subs = {f"{node.module}.{a.name}" for a in node.names} & files.keys()
                if subs:
                    targets |= subs
                    if all(f"{node.module}.{a.name}" in files for a in node.names):
                        targets.discard(node.module)
        graph[name] = targets - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    found = cycles(import_graph())
    assert [c for c in found if c not in KNOWN_CYCLES] == []


def test_the_folders_say_the_order():
    """The layer folders sit at the root, as docs/design.md §2 lists them."""
    assert all((ROOT / layer / "__init__.py").is_file() for layer in LAYERS)
    design = (ROOT / "docs" / "design.md").read_text()
    table = [line for line in design.splitlines() if line.startswith("| `")]
    assert [line.split("`")[1].rstrip("/") for line in table][: len(LAYERS)] == list(LAYERS)


def test_the_engine_refuses_config_models_and_click(tmp_path, monkeypatch):
    """The check itself: a storage module importing click or a config model is found."""
    folder = tmp_path / "storage"
    folder.mkdir()
    (folder / "bad.py").write_text(
        "import click\nfrom gagpo.schemas.config import Config\nfrom gagpo.schemas import layout\n"
    )
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    assert violations("storage") == [
        "storage/bad.py:1 imports click",
        "storage/bad.py:2 imports gagpo.schemas.config",
    ]
